"""Which attention path a padding-free call takes on this machine, per family (a maintainer's
check on the GPU machine: the varlen flash kernel's availability and the keyword arguments each
family's attention calls carry)."""

import torch
import transformers as tf
from fastlayers.patching.runtime import varlen

import fastlayers

print("varlen_attn:", None if varlen._VARLEN is None else sorted(varlen._VARLEN[1]))
seen = []
original = varlen._flash_applies


def spy(query, rest, module, window, max_len):
    took = original(query, rest, module, window, max_len)
    seen.append((type(module).__name__, sorted(rest), took))
    return took


varlen._flash_applies = spy
tiny = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
for build in (
    lambda: tf.BertModel(tf.BertConfig(num_hidden_layers=1, **tiny)),
    lambda: tf.LlamaModel(tf.LlamaConfig(num_hidden_layers=1, num_key_value_heads=2, **tiny)),
):
    model = build().cuda().to(torch.bfloat16).eval()
    fastlayers.patch(model, unpad=True)
    ids = torch.randint(3, 90, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    print(type(model).__name__, dict(model.forward.stats), seen[-1])
