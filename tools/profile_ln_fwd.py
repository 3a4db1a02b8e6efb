"""ncu target: LayerNorm and RMSNorm forwards (bf16, 32768x4096), ours and Liger's, 3 calls each."""

import torch

import fastlayers  # noqa: F401

ops = torch.ops.fastlayers
x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    ops.layer_norm_fwd(x, [4096], w, b, 1e-5)
    ops.rms_norm_fwd(x, [4096], w, 1e-6, 1)
try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    for _ in range(3):
        LigerLayerNormFunction.apply(x, w, b, 1e-5)
except Exception as e:
    print("liger:", e)
torch.cuda.synchronize()
