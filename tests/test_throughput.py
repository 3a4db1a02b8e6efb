"""The main job times what users run: real texts of varied length, sorted and batched as
sentence-transformers batches them (padded to each batch's longest), native eager against patched
eager and, on CUDA, patched with replay; the check compares on a real batch."""

import json

import pytest
import torch
from fastlayers.patching.checking import models as hf_models
from fastlayers.patching.checking.throughput import real_batches, real_texts
from test_check import needs_default_model

from fastlayers.__main__ import main


def test_real_texts_are_prose_of_varied_length_in_a_fixed_order():
    texts = real_texts()
    assert len(texts) > 1000 and texts == real_texts()
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[len(lengths) // 2] >= 10 and lengths[-1] >= 100
    assert all(sum(c.isalpha() for c in t) > 0.7 * len(t) for t in texts)


@needs_default_model
def test_real_batches_are_sorted_and_padded_to_their_longest():
    tokenizer, _ = hf_models.load_tokenizer(hf_models.default_model_path())
    texts = real_texts()[:50]
    data = real_batches(tokenizer, texts, 16, 128, torch.device("cpu"))
    assert data.texts == 50 and len(data.batches) == 4  # 16 + 16 + 16 + 2
    widths = [b["attention_mask"].shape[1] for b in data.batches]
    assert widths == sorted(widths, reverse=True)  # longest texts first
    for b in data.batches:
        mask = b["attention_mask"]
        assert mask[:, -1].any()  # padded to the longest of this batch, no further
        assert mask.sum(1).max() == mask.shape[1] or mask.shape[1] == 128
    real = sum(int(b["attention_mask"].sum()) for b in data.batches)
    total = sum(b["attention_mask"].numel() for b in data.batches)
    assert data.padding_share == pytest.approx(1 - real / total)
    assert 0 < data.padding_share < 0.6


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


@needs_default_model
def test_the_main_job_times_real_length_batches_by_default(capsys, tmp_path):
    path = tmp_path / "report.json"
    args = ("--device", "cpu", "--texts", "40", "--batch", "16", "--passes", "1", "--runs", "2")
    code, out, err = _cli(capsys, *args, "--stream", "6", "--json", str(path))
    assert code == 0, out + err
    assert "a real batch: 16 texts padded to their longest" in err  # what the check compares
    assert "real-length encode: 40 texts" in out and "3 batches of 16" in out
    assert "patched + replay  CUDA only" in out
    line = next(row for row in out.splitlines() if row.lstrip().startswith("padding-free"))
    assert "of the padded tokens" in line and line.rstrip().endswith("ok)"), line
    assert out.strip().splitlines()[-1].endswith("(patched against native eager)")
    data = json.loads(path.read_text())
    throughput = data["throughput"]
    assert throughput["texts"] == 40 and throughput["native_s"] > 0
    assert throughput["headline"][0] == "patched"
    assert throughput["unpad_s"] > 0 and throughput["unpad_error"] <= throughput["unpad_tolerance"]
    # the serving stream: random request sizes, unsorted, every way on CPU
    assert "serving stream: 6 requests of 1 to 16 random texts" in out
    stream = data["stream"]
    names = [w["name"] for w in stream["ways"]]
    assert names == ["native eager", "patched, padding-free", "patched"]
    assert all(w["total_s"] > 0 and w["p99_ms"] >= w["p50_ms"] > 0 for w in stream["ways"])
    assert 0 < stream["padding_share"] < 1


@needs_default_model
def test_the_stream_can_be_left_out_and_rejects_a_bad_count(capsys):
    args = ("--device", "cpu", "--texts", "20", "--batch", "16", "--passes", "1", "--runs", "1")
    code, out, err = _cli(capsys, *args, "--stream", "0")
    assert code == 0, out + err
    assert "serving stream" not in out
    with pytest.raises(SystemExit):
        _cli(capsys, *args, "--stream", "-1")
    assert "--stream" in capsys.readouterr().err


def test_stream_requests_are_random_sizes_padded_to_their_longest():
    from fastlayers.patching.checking.stream import stream_requests

    class Tokenizer:  # one token per word, padded to the longest
        def __call__(self, texts, padding, truncation, max_length, return_tensors):
            lengths = [min(len(t.split()), max_length) for t in texts]
            width = max(lengths)
            mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
            return {"input_ids": mask * 7, "attention_mask": mask}

    texts = real_texts()
    requests, share = stream_requests(Tokenizer(), texts, 30, 8, 64, torch.device("cpu"))
    again, _ = stream_requests(Tokenizer(), texts, 30, 8, 64, torch.device("cpu"))
    sizes = [r["attention_mask"].shape[0] for r in requests]
    assert min(sizes) >= 1 and max(sizes) <= 8 and len(set(sizes)) > 3
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(requests, again, strict=True)
    )
    assert 0 < share < 1


@pytest.mark.cuda
@needs_default_model
def test_the_main_job_on_a_gpu_replays_and_reports_it(capsys):
    args = ("--device", "cuda", "--texts", "300", "--passes", "2", "--runs", "3", "--stream", "30")
    code, out, err = _cli(capsys, *args)
    assert code == 0, out + err
    line = next(row for row in out.splitlines() if "patched + replay" in row)
    assert "buckets" in line and line.rstrip().endswith("ok)"), line
    rows = out.split("serving stream:")[1].splitlines()[1:5]
    ways = [row.strip().split("  ")[0] for row in rows]
    assert ways == [
        "native eager",
        "native, cuDNN attention off",
        "patched + replay + padding-free",
        "patched + replay",
    ], ways
    assert "(patched + replay against native eager)" in out.strip().splitlines()[-1]


@needs_default_model
def test_the_padding_free_serving_example_runs(capsys, monkeypatch):
    import runpy
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "serve_padding_free.py"
    argv = [str(example), "--requests", "4", "--max-batch", "4", "--device", "cpu"]
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    assert "4 requests of 1 to 4 texts" in out and "padding-free" in out
    calls = out.split("calls: ")[1].splitlines()[0]
    assert "'padding-free'" in calls, calls
