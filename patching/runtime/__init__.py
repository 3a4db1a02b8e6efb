"""The call-time paths, in one room: what runs for one call of a patched model is decided here,
from one view of the call (call.py: its tensors, attention mask, real lengths). Planning (which
rewrites a model gets) stays in the files beside this package.

- replay.py (with capture_attention.py): host-free replay of inference calls from CUDA graphs
  captured per shape bucket;
- unpad.py (with varlen.py): padding-free execution: a call with an attention mask runs the
  base model on its real tokens only, attention over variable-length sequences."""
