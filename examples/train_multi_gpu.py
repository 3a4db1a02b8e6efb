"""Train a GPT-2 (random weights) natively and patched with fastlayers, data-parallel over
several processes, and compare the two loss curves. The fused layers need no special handling:
patch the model before handing it to accelerate (DDP) or to FSDP2's ``fully_shard``.

    accelerate launch --multi_gpu --num_processes 2 examples/train_multi_gpu.py --mode ddp
    torchrun --nproc_per_node 2 examples/train_multi_gpu.py --mode fsdp2
    (examples/multi_gpu.sh runs both; add --device cpu to try it without GPUs, over gloo)

Rank 0 prints the losses (mean over ranks) of both runs and exits with 1 when they differ by
more than the dtype's noise.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers as tf

import fastlayers

SIZES = {
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 64},
    "small": {"n_embd": 768, "n_layer": 12, "n_head": 12},  # GPT-2 (124M)
    # a LLaMA-family decoder: RMSNorms, add + RMSNorm, the gated MLP
    "llama-tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 128,
    },
}


def build(size: str, patched: bool) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights for both runs
    if size.startswith("llama"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES[size]))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**SIZES[size]))
    if patched:
        report = fastlayers.patch(model)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"patched: {report.counts()}", flush=True)
    return model


def batches(args, rank: int, vocab: int, device) -> list[torch.Tensor]:
    """A few fixed sequences per rank (the model learns them), the same for both runs."""
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randint(0, vocab, (4, args.batch, args.seq), generator=g)
    return [d.to(device) for d in data]


def train_ddp(args, patched: bool, accelerator) -> list[float]:
    model = build(args.size, patched)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)
    vocab = accelerator.unwrap_model(model).config.vocab_size
    data = batches(args, accelerator.process_index, vocab, accelerator.device)
    losses = []
    for step in range(args.steps):
        torch.manual_seed(1000 + step)  # the same dropout masks in both runs
        batch = data[step % len(data)]
        with accelerator.autocast():
            loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    return losses


def train_fsdp2(args, patched: bool, device: torch.device) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(args.size, patched).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else None
    kwargs = {"mp_policy": policy} if policy else {}
    blocks = model.model.layers if hasattr(model, "model") else model.transformer.h
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args, dist.get_rank(), model.config.vocab_size, device)
    losses = []
    for step in range(args.steps):
        torch.manual_seed(1000 + step)
        batch = data[step % len(data)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "fsdp2"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per process")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast / FSDP2 param dtype")
    args = parser.parse_args()

    if args.mode == "ddp":
        from accelerate import Accelerator

        accelerator = Accelerator(
            cpu=args.device == "cpu", mixed_precision="bf16" if args.bf16 else "no"
        )
        rank, world = accelerator.process_index, accelerator.num_processes
        runs = [train_ddp(args, patched, accelerator) for patched in (False, True)]
    else:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device(args.device)
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        runs = [train_fsdp2(args, patched, device) for patched in (False, True)]

    native, patched = runs
    worst = max(abs(a - b) / abs(a) for a, b in zip(native, patched, strict=True))
    tolerance = 3e-2 if args.bf16 else 1e-4
    if rank == 0:
        print(f"{args.mode}, {world} processes, {args.device}, {'bf16' if args.bf16 else 'fp32'}")
        print("step  native loss  patched loss")
        for step in range(0, args.steps, max(1, args.steps // 10)):
            print(f"{step:4d}  {native[step]:.6f}     {patched[step]:.6f}")
        print(f"last  {native[-1]:.6f}     {patched[-1]:.6f}")
        verdict = "PASS" if worst <= tolerance else "FAIL"
        print(
            f"{verdict}: loss curves differ by at most {worst:.3g} relative (tolerance {tolerance})"
        )
    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
