"""Patch a small MLP-block model in place with fastlayers.check (LayerNorm and Linear + GELU
swapped for fused layers around the same Parameter objects) and print the report: what was
swapped, the errors end to end and per layer, the forward time before and after.

    python examples/patch_demo.py [--device cuda|cpu] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse

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
    report = fastlayers.check(model, x)  # runs, patches in place, runs again, compares
    print(report)
    raise SystemExit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
