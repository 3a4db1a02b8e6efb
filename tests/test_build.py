"""The build's decisions (setup.py) and what `python -m fastlayers env` says about them: which
CUDA headers come from torch's nvidia-* wheels, when nvcc cannot build against this torch,
which GPUs the default architectures cover and which path each op takes there."""

import importlib.util
import os
import re
from pathlib import Path

import pytest

from fastlayers import env_report
from fastlayers._extension import _C

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("fastlayers_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the helpers, builds nothing
    return module


def _touch(folder: Path, *names: str) -> None:
    for name in names:
        path = folder / name
        if name.endswith("/"):
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")


def test_only_headers_the_toolkit_lacks_come_from_the_wheels(setup_py, tmp_path):
    toolkit, wheel, other = tmp_path / "toolkit", tmp_path / "cu13", tmp_path / "cudnn"
    _touch(toolkit, "cuda_runtime.h", "cuda_fp16.h", "cccl/", "crt/")
    # A CUDA 13 wheel folder holds its own runtime and CCCL headers next to the libraries'.
    _touch(wheel, "cuda_runtime.h", "cuda_fp16.h", "cccl/", "crt/", "cub/", "thrust/", "nv/")
    _touch(wheel, "cuda/", "cublas_v2.h", "cusparse.h", "cusolver_common.h", "cuda_new_in_13_2.h")
    _touch(other, "cudnn.h", "cusparse.h")
    staging = tmp_path / "staging"
    dirs = setup_py.stage_missing_headers(str(toolkit), [str(wheel), str(other)], str(staging))
    assert dirs == [str(staging)]
    staged = {p.name: os.readlink(p) for p in staging.iterdir()}
    assert set(staged) == {
        "cublas_v2.h",
        "cusparse.h",
        "cusolver_common.h",
        "cuda_new_in_13_2.h",
        "cudnn.h",
    }
    assert staged["cusparse.h"] == str(wheel / "cusparse.h")  # the first folder wins
    # Nothing missing: no include folder at all, and a stale staging folder is removed.
    _touch(toolkit, "cublas_v2.h", "cusparse.h", "cusolver_common.h", "cuda_new_in_13_2.h")
    _touch(toolkit, "cudnn.h")
    assert setup_py.stage_missing_headers(str(toolkit), [str(wheel)], str(staging)) == []
    assert not staging.exists()


def test_an_nvcc_of_another_major_version_stops_the_build_with_one_message(setup_py):
    message = setup_py.version_problem((12, 8), "13.2", "/opt/cuda-12.8")
    assert message is not None
    for part in ("CUDA 12.8", "CUDA 13.2", "/opt/cuda-12.8", "CUDA_HOME", "FASTLAYERS_CPU_ONLY=1"):
        assert part in message
    assert "\n" not in message
    assert setup_py.version_problem(None, "13.2", "/opt/cuda") is not None


@pytest.mark.parametrize("nvcc", [(13, 0), (13, 2), (13, 5)])
def test_an_older_or_newer_minor_version_builds(setup_py, nvcc):
    assert setup_py.version_problem(nvcc, "13.2", "/usr/local/cuda") is None


def test_compile_jobs_are_max_jobs_capped_by_memory(setup_py):
    jobs = setup_py.compile_jobs
    # the 2-core, 24 GB CI machine: two CUTLASS compiles (6.5 GB each) fit, so do two others
    assert jobs("2", 2, 23.5, setup_py.CUTLASS_COMPILE_GB) == 2
    assert jobs("2", 2, 23.5, setup_py.OTHER_COMPILE_GB) == 2
    # the GPU machine: MAX_JOBS=16, 128 GB holds 14 CUTLASS compiles
    assert jobs("16", 16, 128.0, setup_py.CUTLASS_COMPILE_GB) == 14
    assert jobs(None, 16, 32.0, 6.5) == 3  # no MAX_JOBS: the CPU count, capped by memory
    assert jobs("abc", 4, None, 6.5) == 4  # not a number: the CPU count; memory unknown: no cap
    assert jobs("8", 8, 4.0, 6.5) == 1  # never below one


def test_heaviest_sources_compile_first(setup_py, tmp_path):
    sizes = {"a.cpp": 900, "b.cu": 100, "c.cu": 500, "d.cpp": 50}
    paths = []
    for name, size in sizes.items():
        path = tmp_path / name
        path.write_text("x" * size)
        paths.append(str(path))
    order = setup_py.heaviest_first(paths)
    assert [os.path.basename(paths[i]) for i in order] == ["c.cu", "b.cu", "a.cpp", "d.cpp"]


def test_arch_list_parsing(setup_py):
    assert setup_py.arch_numbers("8.0+PTX;9.0a") == "80,90"
    assert setup_py.arch_numbers("8.0+PTX;9.0a", ptx=True) == "80"
    assert setup_py.arch_numbers("7.5 8.6+PTX 9.0a") == "75,86,90"
    assert setup_py.parse_arch_list(" 9.0a+PTX ;") == [("9.0a", True)]
    # The default covers Ampere/Ada (sm_80 code), Hopper (sm_90a) and newer GPUs (PTX).
    assert setup_py.parse_arch_list(setup_py.DEFAULT_CUDA_ARCHS) == [
        ("8.0", True),
        ("9.0a", False),
    ]


DEFAULT_BUILD = {
    "cuda": True,
    "cuda_archs": [80, 90],
    "cuda_ptx_archs": [80],
    "cutlass_sm90": True,
    "cutlass_sm80": False,  # built only with FASTLAYERS_BUILD_SM80=1
}
SM80_OPT_IN_BUILD = {**DEFAULT_BUILD, "cutlass_sm80": True}


@pytest.mark.parametrize(
    ("capability", "image"),
    [
        ((8, 0), "sm_80 machine code"),  # A100
        ((8, 6), "sm_80 machine code"),  # A10G, RTX 30
        ((8, 9), "sm_80 machine code"),  # L4, RTX 40
        ((9, 0), "sm_90 machine code"),  # H100, H200
        ((10, 0), "compute_80 PTX, compiled by the driver on first use"),  # B200
        ((12, 0), "compute_80 PTX, compiled by the driver on first use"),  # RTX 50
        ((7, 5), None),  # T4: older than every target
    ],
)
def test_which_gpus_the_default_build_runs_on(capability, image):
    assert env_report.kernel_image(capability, DEFAULT_BUILD) == image


def test_op_paths_say_which_gemm_and_why():
    hopper = env_report.op_paths((9, 0), DEFAULT_BUILD)
    assert hopper["linear_gelu"].startswith("fused CUTLASS sm_90a GEMM")
    assert "epilogue of the CUTLASS sm_90a GEMM" in hopper["mlp_backward"]
    assert "sm_90 machine code" in hopper["layer_norm"]
    ampere = env_report.op_paths((8, 6), SM80_OPT_IN_BUILD)
    assert ampere["linear_gelu"].startswith("fused CUTLASS sm_80 GEMM")
    assert "in_features up to 2048" in ampere["linear_gelu"]
    assert ampere["mlp_backward"].startswith("cuBLAS GEMM dy . W2, then the elementwise")
    assert "sm_86" in ampere["mlp_backward"]
    # the default build leaves the sm_80 GEMM out: 8.x GPUs take cuBLAS + the activation pass
    ampere_default = env_report.op_paths((8, 0), DEFAULT_BUILD)
    assert ampere_default["linear_gelu"].startswith("cuBLAS GEMM + GELU pass")
    assert "sm_80" in ampere_default["linear_gelu"]
    blackwell = env_report.op_paths((10, 0), DEFAULT_BUILD)
    assert blackwell["linear_gelu"].startswith("cuBLAS GEMM + GELU pass")
    no_cutlass = env_report.op_paths((9, 0), {**DEFAULT_BUILD, "cutlass_sm90": False})
    assert "without the CUTLASS" in no_cutlass["linear_gelu"]
    turing = env_report.op_paths((7, 5), DEFAULT_BUILD)
    assert all("sm_75" in path and "native PyTorch ops" in path for path in turing.values())
    cpu_only = env_report.op_paths((9, 0), {"cuda": False, "cuda_archs": [], "cutlass_sm90": False})
    assert all("no CUDA kernels" in path for path in cpu_only.values())
    assert set(env_report.op_paths(None, DEFAULT_BUILD)) == set(hopper)


def _in_features_limit(text: str) -> int:
    """N of the rule text's "in_features up to N"."""
    match = re.search(r"in_features up to (\d+)", text)
    assert match, text
    return int(match.group(1))


def test_path_rules_in_words_state_the_rules_that_run():
    """`fastlayers env` prints the rules from the extension (_C.path_rules(), built from the C++
    rule's constants): the limits it states are the ones the size rules apply."""
    rules = _C.path_rules()
    assert set(rules) == {
        "fused_gemm_inputs",
        "sm90_forward",
        "sm90_relu_bias",
        "sm90_backward",
        "sm80_forward",
    }
    hopper = env_report.op_paths((9, 0), DEFAULT_BUILD)
    assert rules["sm90_forward"] in hopper["linear_gelu"]
    assert rules["fused_gemm_inputs"] in hopper["linear_relu"]
    assert rules["sm90_relu_bias"] in hopper["linear_relu"]
    assert rules["sm90_backward"] in hopper["mlp_backward"]
    sms, rows, n = 132, 8192, 3072  # three waves and up of 128x128 tiles on an H100
    one_kernel, grad_pass = 1, 2
    limit = _in_features_limit(rules["sm90_relu_bias"])
    assert _C._testing.sm90_size_refusal(rows, n, limit, sms, one_kernel) is None
    assert _C._testing.sm90_size_refusal(rows, n, limit + 8, sms, one_kernel) is not None
    limit = _in_features_limit(rules["sm80_forward"])
    assert _C._testing.sm80_size_refusal(rows, n, limit, 108) is None
    assert _C._testing.sm80_size_refusal(rows, n, limit + 8, 108) is not None
    # the backward GEMM: any number of rows up to the stated in_features (here 384 rows, whose
    # 128x128 tiles fill two waves poorly), the waves rule past it
    match = re.search(r"up to (\d+) in_features \(of dy", rules["sm90_backward"])
    assert match, rules["sm90_backward"]
    limit = int(match.group(1))
    assert _C._testing.sm90_size_refusal(384, 8192, limit, sms, grad_pass) is None
    assert _C._testing.sm90_size_refusal(384, 8192, limit + 1024, sms, grad_pass) is not None


def test_env_command_prints_paths_for_the_cpu(capsys):
    from fastlayers.__main__ import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "linear_gelu" in out and "built for" in out
