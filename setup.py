"""Builds fastlayers._C: CUDA kernels when a CUDA toolkit and a CUDA build of torch are present,
CPU kernels only otherwise (or when FASTLAYERS_CPU_ONLY=1).

TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: "8.0;9.0a"); MAX_JOBS the parallel
compile jobs. The fused Linear + GELU GEMM for Hopper (sm_90a) needs the CUTLASS headers of the
nvidia-cutlass package (pip install --no-deps nvidia-cutlass) at build time; without them, or
without 9.0a in the list, that op uses its cuBLAS + GELU fallback on every GPU.
"""

import glob
import importlib.util
import os
import re
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

DEFAULT_CUDA_ARCHS = "8.0;9.0a"


def _build_cuda() -> bool:
    if os.environ.get("FASTLAYERS_CPU_ONLY", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _arch_numbers(arch_list: str) -> str:
    """'8.0;9.0a' -> '80,90' for the build-info macro (no quotes or semicolons on the
    compiler command line)."""
    nums = re.findall(r"(\d+)\.(\d+)", arch_list)
    return ",".join(f"{major}{minor}" for major, minor in nums)


def _cuda_library_include_dirs() -> list[str]:
    """Headers of the CUDA math libraries (cuSPARSE, cuBLAS, ...) that ATen's CUDA headers
    include. A toolkit with only the compiler lacks them; the nvidia-* wheels that a CUDA build
    of torch depends on ship them."""
    if os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    found = []
    for base in nvidia.__path__:
        found += [
            os.path.dirname(h) for h in glob.glob(os.path.join(base, "*", "include", "cusparse.h"))
        ]
    return sorted(set(found))


def _cudart_library_dirs() -> list[str]:
    """Where libcudart.so is, when not beside CUDA_HOME (e.g. nvcc installed on the PATH
    outside its toolkit folder)."""
    candidates = [os.path.join(CUDA_HOME, d, "libcudart.so") for d in ("lib64", "lib")]
    if any(os.path.exists(c) for c in candidates):
        return []
    found = glob.glob("/usr/local/cuda*/lib*/libcudart.so") + glob.glob(
        "/usr/local/cuda*/targets/*/lib/libcudart.so"
    )
    return sorted({os.path.dirname(f) for f in found})[:1]


def _cutlass_include_dirs() -> list[str]:
    """The CUTLASS C++ headers shipped in the nvidia-cutlass wheel (package cutlass_library),
    found without importing it (its Python side needs packages the build does not)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return []
    source = os.path.join(next(iter(spec.submodule_search_locations)), "source")
    dirs = [os.path.join(source, "include"), os.path.join(source, "tools", "util", "include")]
    if not os.path.exists(os.path.join(dirs[0], "cutlass", "cutlass.h")):
        return []
    return dirs


def _extension():
    torch_major, torch_minor = torch.__version__.split(".")[:2]
    macros = [("FASTLAYERS_TORCH_MAJOR", torch_major), ("FASTLAYERS_TORCH_MINOR", torch_minor)]
    sources = sorted(glob.glob("csrc/*.cpp"))
    cxx_flags = ["-O3"]
    if not _build_cuda():
        return CppExtension(
            "fastlayers._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx_flags}
        )
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    macros += [("FASTLAYERS_WITH_CUDA", "1")]
    # cxx only: nvcc would split the comma-separated value into several -D options.
    cxx_flags += [f"-DFASTLAYERS_CUDA_ARCHS={_arch_numbers(arch_list)}"]
    # NDEBUG: device-side asserts compile to calls, which serialize CUTLASS's wgmma pipeline.
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DNDEBUG"]
    include_dirs = _cuda_library_include_dirs()
    cutlass_dirs = _cutlass_include_dirs()
    if cutlass_dirs and "9.0a" in arch_list.split(";"):
        macros += [("FASTLAYERS_WITH_CUTLASS_SM90", "1")]
        include_dirs += cutlass_dirs
        nvcc_flags += ["-diag-suppress=2908"]  # a CUTLASS header's lambda capture warning
    else:
        print(
            "fastlayers: building without the sm_90a fused Linear+GELU kernels ("
            + ("TORCH_CUDA_ARCH_LIST has no 9.0a" if cutlass_dirs else "nvidia-cutlass not found")
            + "); FusedLinearGELU will use its cuBLAS + GELU path",
            file=sys.stderr,
        )
    return CUDAExtension(
        "fastlayers._C",
        sources + sorted(glob.glob("csrc/*.cu")),
        define_macros=macros,
        include_dirs=include_dirs,
        library_dirs=_cudart_library_dirs(),
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    packages=["fastlayers", "fastlayers.ops", "fastlayers.layers", "fastlayers.patching"],
    package_dir={"fastlayers.patching": "patching"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
)
