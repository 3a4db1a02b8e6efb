"""Exporting a patched model: ONNX (both exporters) gives the native computation in standard ONNX
ops, checked with onnxruntime; torch.export and torch.jit.trace keep fastlayers' ops."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import tiny_models
import torch
from fastlayers.patching.blocks import rewritten_forward
from torch import nn

import fastlayers

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


EXPORTERS = [
    pytest.param(False, id="torchscript"),
    pytest.param(
        True,
        id="dynamo",
        marks=pytest.mark.skipif(not _has("onnxscript"), reason="needs onnxscript"),
    ),
]


class _LastHidden(nn.Module):
    """A HuggingFace model as ids -> last_hidden_state, one tensor in and out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).last_hidden_state


def _export(module: nn.Module, x: torch.Tensor, path, dynamo: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=dynamo, input_names=["x"])
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    return model


def _op_types(model) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


def _assert_standard_onnx(model) -> None:
    foreign = [(n.domain, n.op_type) for n in model.graph.node if n.domain not in ("", "ai.onnx")]
    assert not foreign, f"non-standard ops in the graph: {foreign}"
    assert not any("fastlayers" in n.op_type.lower() for n in model.graph.node)


def _run_onnx(path, x: torch.Tensor) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def _gelu_forms(model) -> list[str]:
    return [
        attr.s.decode()
        for node in model.graph.node
        if node.op_type == "Gelu"
        for attr in node.attribute
        if attr.name == "approximate"
    ]


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("name,gelu", [("bert", "none"), ("gpt2", "tanh")])
def test_onnx_export_of_patched_hf_model_is_native(name, gelu, dynamo, tmp_path):
    """A patched tiny BERT (erf GELU) / GPT-2 (tanh GELU, Conv1D) exports with LayerNormalization
    and Gelu of the right form, no fastlayers op, and onnxruntime matches native eager."""
    native = _LastHidden(tiny_models.build(name)).eval()
    x = tiny_models.make_inputs("ids", "cpu", batch=2, seq=7)["input_ids"]
    with torch.no_grad():
        want = native(x)
    patched = copy.deepcopy(native)
    report = fastlayers.patch(patched)
    # BERT: dense + GELU fused (BertIntermediate); GPT-2: GPT2MLP rewritten (rule mlp)
    assert report.counts()["linear_gelu" if name == "bert" else "mlp"] == 2, str(report)
    assert any(isinstance(m, fastlayers.LayerNorm) for m in patched.modules())
    model = _export(patched, x, tmp_path / "patched.onnx", dynamo)
    _assert_standard_onnx(model)
    ops = _op_types(model)
    assert ops["LayerNormalization"] == 5, dict(ops)
    assert _gelu_forms(model) == [gelu, gelu], dict(ops)
    got = _run_onnx(tmp_path / "patched.onnx", x)
    # float32: the two GELU forms differ by up to ~5e-4, far above this bound
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_onnx_export_of_each_layer(dynamo, tmp_path):
    """Each fused layer exports as its native ops: LayerNormalization; Gemm/MatMul + Gelu;
    Relu (+ Mul for alpha != 1), also in place; onnxruntime matches the layer in eager."""
    x = torch.randn(3, 5, 16)
    cases = {
        "layer_norm": (fastlayers.LayerNorm(16), {"LayerNormalization"}),
        "linear_gelu": (fastlayers.FusedLinearGELU(16, 8, approximate="tanh"), {"Gelu"}),
        "relu": (fastlayers.ReLUScale(1.0), {"Relu"}),
        "relu_scale": (fastlayers.ReLUScale(-0.5), {"Relu", "Mul"}),
        "relu_scale_inplace": (
            nn.Sequential(nn.Identity(), fastlayers.ReLUScale(3.0, True)),
            {"Relu", "Mul"},
        ),
    }
    for name, (layer, expected) in cases.items():
        path = tmp_path / f"{name}.onnx"
        model = _export(layer.eval(), x, path, dynamo)
        _assert_standard_onnx(model)
        ops = set(_op_types(model))
        assert expected <= ops, (name, ops)
        if name == "linear_gelu":
            assert ops & {"Gemm", "MatMul"}, ops
        with torch.no_grad():
            want = layer(x.clone())
        torch.testing.assert_close(_run_onnx(path, x), want, rtol=1e-5, atol=1e-6, msg=name)


def _sequential(
    layers=("layer_norm", "linear_gelu", "linear_relu"),
) -> tuple[nn.Module, torch.Tensor]:
    model = tiny_models.build("sequential")
    fastlayers.patch(model, layers=layers)
    return model, tiny_models.make_inputs("features", "cpu")["input"]


def test_torch_export_keeps_fused_ops():
    """torch.export (not ONNX) is unchanged: the exported graph calls fastlayers' ops."""
    model, x = _sequential()
    program = torch.export.export(model, (x,))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    # Linear + GELU and Linear + ReLU pairs (the ReLU no longer a relu_scale of its own)
    assert "fastlayers.linear_act_fwd.default" in targets, targets
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)


def test_torch_export_of_a_rewritten_root_module():
    """The Sequential's own forward rewritten (rule mlp: its forward is an instance attribute):
    torch.export traces the rewritten code and computes what the model computes."""
    model, x = _sequential(layers=("mlp",))
    assert rewritten_forward(model) is not None
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)


def test_jit_trace_keeps_fused_ops():
    """torch.jit.trace records fastlayers' ops (loading the artifact needs `import fastlayers`)."""
    model, x = _sequential()
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        assert "fastlayers::" in str(traced.inlined_graph)
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "layer",
    [
        lambda: fastlayers.LayerNorm(8),
        lambda: fastlayers.FusedLinearGELU(8, 8),
        lambda: fastlayers.ReLUScale(0.5),
    ],
    ids=["layer_norm", "linear_gelu", "relu_scale"],
)
def test_jit_script_refuses_in_one_line_and_leaves_the_model_as_it_was(layer):
    model = nn.Sequential(nn.Linear(8, 8), layer())
    children = list(model)
    with pytest.raises(RuntimeError, match=r"script the model before patching") as err:
        torch.jit.script(model)
    assert type(children[1]).__name__ in str(err.value) and "\n" not in str(err.value)
    assert list(model) == children  # nothing swapped in place
    torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))  # native still scripts
