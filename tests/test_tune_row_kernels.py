"""tools/tune_row_kernels.py calls the ops directly, with their schemas' argument lists: every
case it times runs here on the CPU kernels, so a schema change the tool did not follow (as
gated_act_bwd's three-output mask once) fails in CI, not on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from tools import tune_row_kernels as tool

# a width the vector paths take and one they do not
SHAPES = [(5, 64), (3, 33)]


@pytest.mark.parametrize("op", tool.OP_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_case_runs_with_the_ops_schemas(op, dtype, shape):
    rows, cols = shape
    elem = torch.empty((), dtype=dtype).element_size()
    seen = []
    for pas, knob, nbytes, fn in tool.cases(op, rows, cols, dtype, dev="cpu"):
        out = fn()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # each case returns the op's outputs: the first is the normalised row or a gradient of
        # the input's shape, finite on random inputs
        assert outs[0].shape == (rows, cols), (op, pas)
        assert torch.isfinite(outs[0].float()).all(), (op, pas)
        # the floor counts whole tensors of the input's size
        assert nbytes % (rows * cols * elem) == 0 and nbytes > 0, (op, pas)
        assert knob is None or knob.startswith("FASTLAYERS_"), (op, pas)
        seen.append(pas)
    assert seen[0] == "fwd"
    assert set(seen) <= {"fwd", "bwd", "bwd_product"}


def test_an_unknown_op_is_named():
    with pytest.raises(SystemExit, match="'nope'"):
        list(tool.cases("nope", 2, 8, torch.float32, dev="cpu"))
