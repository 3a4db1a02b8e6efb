"""What ``python -m fastlayers env`` says: versions, how the extension was built, and for each
visible GPU which path each op takes there and why."""

from __future__ import annotations

from typing import Any

import torch


def _path_rules() -> dict[str, str]:
    """The fused GEMMs' rules in words, from the extension that applies them."""
    from fastlayers._extension import _C

    return _C.path_rules()


def kernel_image(capability: tuple[int, int], info: dict[str, Any]) -> str | None:
    """How the build's CUDA kernels run on a GPU of compute ``capability``: its own machine code,
    PTX that the driver compiles when the extension first runs there, or None (no kernels).

    Machine code for sm_XY runs on GPUs of the same major version and a minor version >= Y;
    PTX for compute_XY runs on every GPU of compute capability >= X.Y."""
    if not info.get("cuda"):
        return None
    major, minor = capability
    for arch in sorted(info["cuda_archs"], reverse=True):
        if arch // 10 == major and arch % 10 <= minor:
            return f"sm_{arch} machine code"
    ptx = [a for a in info.get("cuda_ptx_archs", []) if a <= major * 10 + minor]
    if ptx:
        return f"compute_{max(ptx)} PTX, compiled by the driver on first use"
    return None


def op_paths(capability: tuple[int, int] | None, info: dict[str, Any]) -> dict[str, str]:
    """For a GPU of compute ``capability`` (None: the CPU), the path each op takes and why."""
    if capability is None:
        return {
            "layer_norm": "CPU: ATen's layer_norm kernels (native's numbers); fastlayers' own "
            "for parameters of two dtypes or a float32 output from a half input",
            "relu_scale": "CPU: fastlayers' one-pass loop for float32/float64 with alpha != 1; "
            "torch.relu (and the product) otherwise, bit-identical to native",
            "linear_gelu": "CPU: ATen linear + GELU (bit-identical to nn.Linear + nn.GELU)",
            "linear_relu": "CPU: ATen linear + relu (bit-identical to nn.Linear + nn.ReLU)",
            "mlp_backward": "CPU: ATen GEMM, then the activation's derivative in float",
        }
    image = kernel_image(capability, info)
    sm = f"sm_{capability[0]}{capability[1]}"
    if image is None:
        why = (
            "this build has no CUDA kernels"
            if not info.get("cuda")
            else f"the build has no kernels for {sm}; rebuild with TORCH_CUDA_ARCH_LIST"
        )
        # The layers compute with torch's own ops there (one warning); patch leaves the ones
        # with parameters native.
        native = (
            f"native PyTorch ops, with a warning ({why}); "
            "patch() leaves LayerNorm and Linear + activation native there"
        )
        return dict.fromkeys(
            ("layer_norm", "relu_scale", "linear_gelu", "linear_relu", "mlp_backward"), native
        )
    rules = _path_rules()
    fit = rules["fused_gemm_inputs"]
    relu_lt = "cuBLASLt GEMM with its bias + ReLU epilogue (one kernel)"
    mlp_pass = "cuBLAS GEMM dy . W2, then the elementwise backward pass"
    if capability == (9, 0) and info.get("cutlass_sm90"):
        gemm = (
            f"fused CUTLASS sm_90a GEMM + bias + GELU for {fit}, {rules['sm90_forward']}; "
            "other calls: "
            "cuBLAS GEMM + GELU pass"
        )
        relu = (
            f"fused CUTLASS sm_90a GEMM + bias + ReLU for {fit}, {rules['sm90_forward']} (with "
            f"a bias: {rules['sm90_relu_bias']}); other calls: {relu_lt} (without a bias: cuBLAS "
            "GEMM + ReLU pass)"
        )
        mlp = (
            "the activation's derivative in the epilogue of the CUTLASS sm_90a GEMM dy . W2 "
            f"for {fit}, {rules['sm90_backward']}; other calls: {mlp_pass}"
        )
    elif capability == (9, 0):
        gemm = "cuBLAS GEMM + GELU pass: built without the CUTLASS sm_90a kernels"
        relu = f"{relu_lt}: built without the CUTLASS sm_90a kernels"
        mlp = f"{mlp_pass}: built without the CUTLASS sm_90a kernels"
    elif capability[0] == 8 and info.get("cutlass_sm80"):
        gemm = (
            f"fused CUTLASS sm_80 GEMM + bias + GELU for {fit}, {rules['sm80_forward']}; "
            "other calls: "
            "cuBLAS GEMM + GELU pass"
        )
        relu = (
            f"{relu_lt} (with a bias); without a bias: fused CUTLASS sm_80 GEMM + ReLU for "
            f"{fit}, {rules['sm80_forward']}, other calls cuBLAS GEMM + ReLU pass"
        )
        mlp = f"{mlp_pass}: the fused backward GEMM is built for sm_90a only, this is {sm}"
    else:
        built = "sm_90a and sm_80 (8.x)" if info.get("cutlass_sm80") else "sm_90a"
        gemm = f"cuBLAS GEMM + GELU pass: the fused GEMMs are built for {built} only, this is {sm}"
        relu = f"{relu_lt}: the CUTLASS GEMMs are built for {built} only, this is {sm}"
        mlp = f"{mlp_pass}: the fused backward GEMM is built for sm_90a only, this is {sm}"
    return {
        "layer_norm": f"fastlayers CUDA kernel ({image})",
        "relu_scale": f"fastlayers CUDA kernel ({image})",
        "linear_gelu": gemm,
        "linear_relu": relu,
        "mlp_backward": mlp,
    }


def report() -> tuple[str, bool]:
    """The text of ``python -m fastlayers env``, and whether fastlayers imported."""
    lines = [f"torch           {torch.__version__} (CUDA {torch.version.cuda or 'none'})"]
    try:
        import fastlayers
    except ImportError as err:
        return "\n".join([*lines, f"fastlayers      not importable: {err}"]), False
    info = fastlayers.build_info()
    archs = ", ".join(f"sm_{a}" for a in info["cuda_archs"]) or "none"
    ptx = ", ".join(f"compute_{a}" for a in info.get("cuda_ptx_archs", [])) or "none"
    lines += [
        f"fastlayers      {fastlayers.__version__}",
        f"CUDA kernels    {'built' if info['cuda'] else 'not built (CPU kernels only)'}",
        f"built for       {archs}; PTX {ptx}; CUTLASS sm_90a GEMM "
        f"{'built' if info['cutlass_sm90'] else 'not built'}; CUTLASS sm_80 GEMM "
        f"{'built' if info.get('cutlass_sm80') else 'not built'}",
    ]
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            name = f"GPU {i} {torch.cuda.get_device_name(i)}, sm_{cap[0]}{cap[1]}"
            devices.append((name, cap))
    else:
        lines.append("GPU             none visible")
    devices.append(("CPU", None))
    for name, cap in devices:
        lines.append(f"{name}:")
        lines += [f"  {op:<13} {path}" for op, path in op_paths(cap, info).items()]
    return "\n".join(lines), True
