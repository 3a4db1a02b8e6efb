"""scripts/sanitize_driver.py, the program device_sanitize.sh runs under compute-sanitizer: its
case numbering (a run that the tool killed goes on from the next case) and its reading of a
sanitizer log (the tool's own failures apart from findings in kernels)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sanitize_driver.py"


def driver(*args: str, log: str | None = None, tmp_path: Path | None = None):
    if log is not None:
        path = tmp_path / "sanitizer.log"
        path.write_text(log)
        args = ("summarize", str(path), "--tool", "racecheck")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_start_and_stop_select_the_numbered_cases_on_cpu():
    full = driver("run", "--device", "cpu", "--only", "relu_scale,linear_gelu")
    assert full.returncode == 0, full.stderr
    names = [line for line in full.stdout.splitlines() if line.startswith("case ")]
    assert [int(n.split()[1].rstrip(":")) for n in names] == list(range(len(names)))
    assert f"sanitize_driver: {len(names)} calls done on cpu" in full.stdout
    part = driver(
        "run", "--device", "cpu", "--only", "relu_scale,linear_gelu", "--start", "5", "--stop", "8"
    )
    assert part.returncode == 0, part.stderr
    assert [line for line in part.stdout.splitlines() if line.startswith("case ")] == names[5:8]
    assert "sanitize_driver: 3 calls done on cpu" in part.stdout


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
def test_summarize_keeps_tool_failures_apart_from_findings(tmp_path, log, rc, expect):
    out = driver(log=log, tmp_path=tmp_path)
    assert out.returncode == rc, out.stdout + out.stderr
    assert expect in out.stdout, out.stdout
