"""tools/sanitize_driver.py, the program device_sanitize.sh runs under compute-sanitizer: its
case numbering (a run that the tool killed goes on from the next case) and its reading of a
sanitizer log (the tool's own failures apart from findings in kernels). Called in this process
through its command line (main), so torch is imported once."""

from __future__ import annotations

import pytest

from tools import sanitize_driver

SCRIPT = sanitize_driver.__file__


def driver(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """(exit code, stdout) of `sanitize_driver.py ARGS`."""
    monkeypatch.setattr("sys.argv", [str(SCRIPT), *args])
    rc = sanitize_driver.main()
    return rc, capsys.readouterr().out


def test_start_and_stop_select_the_numbered_cases_on_cpu(monkeypatch, capsys):
    only = ("--device", "cpu", "--only", "relu_scale,linear_gelu")
    rc, full = driver(monkeypatch, capsys, "run", *only)
    assert rc == 0
    names = [line for line in full.splitlines() if line.startswith("case ")]
    assert [int(n.split()[1].rstrip(":")) for n in names] == list(range(len(names)))
    assert f"sanitize_driver: {len(names)} calls done on cpu" in full
    rc, part = driver(monkeypatch, capsys, "run", *only, "--start", "5", "--stop", "8")
    assert rc == 0
    assert [line for line in part.splitlines() if line.startswith("case ")] == names[5:8]
    assert "sanitize_driver: 3 calls done on cpu" in part


CRASH = """========= COMPUTE-SANITIZER
========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.
=========
========= Target application returned an error
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
CLEAN = """========= COMPUTE-SANITIZER
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
HAZARD = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at void fastlayers::dgelu_bias_kernel<float, 4>(const float *, const float *, float *, float *, long, long, long, fastlayers::GeluForm)+0x1f0
=========     and Read access at void fastlayers::dgelu_bias_kernel<float, 4>(const float *, const float *, float *, float *, long, long, long, fastlayers::GeluForm)+0x2a0 [2 hazards]
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""  # noqa: E501


@pytest.mark.parametrize(
    "log, rc, expect",
    [
        (
            CRASH + CLEAN,
            0,
            "ours 0 [none]; others 0 [none]; unattributed 0 [none]; tool failures 1",
        ),
        (CLEAN + HAZARD, 1, "ours 1 [fastlayers::dgelu_bias_kernel x1]"),
        (CRASH + HAZARD, 1, "tool failures 1"),
        ("", 1, "no summary line"),
    ],
    ids=["tool-died-then-clean", "hazard-in-ours", "both", "empty-log"],
)
def test_summarize_keeps_tool_failures_apart_from_findings(
    monkeypatch, capsys, tmp_path, log, rc, expect
):
    path = tmp_path / "sanitizer.log"
    path.write_text(log)
    got_rc, out = driver(monkeypatch, capsys, "summarize", str(path), "--tool", "racecheck")
    assert got_rc == rc, out
    assert expect in out, out


def test_kernel_functions_finds_every_global_function_by_name():
    # A __launch_bounds__ whose arguments nest two calls deep (ln_bwd_vec_kernel) was read as a
    # kernel named "__launch_bounds__", and the kernel itself was never expected.
    names = sanitize_driver.kernel_functions()
    assert "__launch_bounds__" not in names
    assert {"ln_bwd_vec_kernel", "ln_fwd_vec_kernel", "dact_bias_kernel"} <= set(names)


@pytest.mark.parametrize(
    ("name", "label"),
    [
        (
            "void fastlayers::ln_fwd_vec_kernel<4, fastlayers::DropoutAddSrc<c10::BFloat16, "
            "float>>(fastlayers::DropoutAddSrc<c10::BFloat16, float>, void const*)",
            ("ln_fwd_vec_kernel", "bf16"),
        ),
        (
            "void fastlayers::cuda::elementwise_kernel<c10::Half, false, 1, "
            "fastlayers::(anonymous namespace)::ActForward>(c10::Half const*, long)",
            ("elementwise_kernel ActForward", "fp16"),
        ),
        ("void at::native::elementwise_kernel<128, 4>(int)", None),
    ],
)
def test_kernel_label_reads_the_dtype_from_any_template_argument(name, label):
    # The LayerNorm kernels lead with an int template argument; their dtype comes later.
    ours = sanitize_driver.kernel_functions()
    assert sanitize_driver.kernel_label(name, ours) == label
