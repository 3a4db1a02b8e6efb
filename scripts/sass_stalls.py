"""Summarise the per-instruction warp-stall samples that scripts/device_epilogue_stalls.sh
brings back (Nsight Compute's source page, SASS, as gzipped CSV): the stall reasons over the whole
kernel and over its floating-point math (the activation epilogue's instructions), and the
instructions executed and sampled per opcode.

    python scripts/sass_stalls.py DIR [identity tanh erf]
"""

from __future__ import annotations

import collections
import csv
import gzip
import os
import sys

MATH_OPS = {"FFMA", "FMUL", "FADD", "MUFU", "FMNMX", "F2FP"}


def opcode(source: str) -> str:
    words = source.split()
    word = words[1] if words and words[0].startswith("@") else (words[0] if words else "")
    return word.split(".")[0]


def summarise(path: str) -> None:
    with gzip.open(path, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]  # row 0 names the kernel
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    whole, math = collections.Counter(), collections.Counter()
    executed, sampled = collections.Counter(), collections.Counter()
    for row in data:
        op = opcode(row[col["Source"]])
        executed[op] += int(row[col["Instructions Executed"]] or 0)
        sampled[op] += int(row[col["# Samples"]] or 0)
        for reason in reasons:
            count = int(row[col[reason]] or 0)
            whole[reason] += count
            if op in MATH_OPS:
                math[reason] += count

    def shares(counter: collections.Counter) -> str:
        total = sum(counter.values()) or 1
        top = counter.most_common(8)
        return ", ".join(f"{name[6:]} {100 * n / total:.0f}%" for name, n in top)

    print(f"{os.path.basename(path)}: {sum(executed.values()):,} warp instructions executed")
    print(f"  stalls, whole kernel ({sum(whole.values())} samples): {shares(whole)}")
    print(f"  stalls, float math ({sum(math.values())} samples): {shares(math)}")
    print("  executed by opcode: " + ", ".join(f"{k} {v:,}" for k, v in executed.most_common(8)))
    print("  samples by opcode: " + ", ".join(f"{k} {v}" for k, v in sampled.most_common(8)))


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    folder, names = sys.argv[1], sys.argv[2:] or ["identity", "tanh", "erf"]
    for name in names:
        path = os.path.join(folder, f"source_{name}.csv.gz")
        if os.path.exists(path):
            summarise(path)
        else:
            print(f"{path}: missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
