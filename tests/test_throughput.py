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
    code, out, err = _cli(capsys, *args, "--json", str(path))
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


@pytest.mark.cuda
@needs_default_model
def test_the_main_job_on_a_gpu_replays_and_reports_it(capsys):
    args = ("--device", "cuda", "--texts", "300", "--passes", "2", "--runs", "3")
    code, out, err = _cli(capsys, *args)
    assert code == 0, out + err
    line = next(row for row in out.splitlines() if "patched + replay" in row)
    assert "buckets" in line and line.rstrip().endswith("ok)"), line
    assert "(patched + replay against native eager)" in out.strip().splitlines()[-1]
