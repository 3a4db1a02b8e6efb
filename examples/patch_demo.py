"""Patch a small transformer-style model in place with fastlayers.patch (LayerNorm, Linear +
GELU, ReLU swapped for fused layers around the same Parameter objects), print the patch report,
and show that the outputs did not change.

    python examples/patch_demo.py [--device cuda|cpu] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import fastlayers


class MLPBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def build_model(d: int = 256, depth: int = 4, classes: int = 10) -> nn.Module:
    blocks = [MLPBlock(d) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.LayerNorm(d), nn.Linear(d, classes))


def timed(model: nn.Module, x: torch.Tensor, reps: int = 20) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        out = model(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            model(x)
        if x.is_cuda:
            torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = build_model().to(args.device, dtype).eval()
    x = torch.randn(64, 128, 256, device=args.device, dtype=dtype)

    before, ms_before = timed(model, x)
    keys_before = list(model.state_dict())
    report = fastlayers.patch(model)
    after, ms_after = timed(model, x)

    diff = (after.double() - before.double()).abs()
    cosine = nn.functional.cosine_similarity(after.double().flatten(), before.double().flatten(), 0)
    argmax_agree = (after.argmax(-1) == before.argmax(-1)).double().mean().item()
    print(f"fastlayers {fastlayers.__version__} on {args.device}, {args.dtype}")
    print(report)
    print()
    print(f"state_dict keys unchanged: {list(model.state_dict()) == keys_before}")
    print(f"max abs error      {diff.max().item():.3g}")
    print(f"max rel error      {(diff / before.double().abs().clamp_min(1e-6)).max().item():.3g}")
    print(f"cosine similarity  {cosine.item():.8f}")
    print(f"argmax agreement   {argmax_agree:.4f}")
    print(f"forward time       {ms_before:.2f} ms before, {ms_after:.2f} ms after")


if __name__ == "__main__":
    main()
