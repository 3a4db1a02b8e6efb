"""Data-parallel training of a patched model, two processes over gloo on CPU: DDP through
accelerate and FSDP2 (fully_shard), native vs patched loss curves (examples/train_multi_gpu.py,
the script the GPU runs use too)."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "examples", "train_multi_gpu.py")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_patched_model_trains_like_native_across_two_processes(mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [SCRIPT, "--mode", mode, "--device", "cpu", "--size", "tiny", "--steps", "10"]
    cmd += ["--batch", "2", "--seq", "32", "--lr", "3e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{mode}, 2 processes, cpu, fp32" in proc.stdout
    counts = "{'layer_norm': 3, 'residual_layer_norm': 2, 'varlen_attention': 2, 'mlp': 2, "
    counts += "'linear_cross_entropy': 1}"
    assert f"patched: {counts}" in proc.stdout
    # GPT2MLP computes linear_act_linear (no call hooks: FSDP2's state_dict hooks are fine)
    assert "computes an MLP natively" not in proc.stderr
    assert "PASS: loss curves differ" in proc.stdout


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_patched_llama_trains_like_native_across_two_processes(mode):
    """The decoder rules (rms_norm, residual_rms_norm, gated_mlp) under DDP and FSDP2."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [SCRIPT, "--mode", mode, "--device", "cpu", "--size", "llama-tiny", "--steps", "10"]
    cmd += ["--batch", "2", "--seq", "32", "--lr", "3e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = "{'rms_norm': 3, 'residual_rms_norm': 2, 'rotary': 2, 'varlen_attention': 2, "
    counts += "'shared_input_linear': 6, 'gated_mlp': 2, "
    counts += "'linear_cross_entropy': 1}"
    assert f"patched: {counts}" in proc.stdout
    assert "natively" not in proc.stderr
    assert "PASS: loss curves differ" in proc.stdout
