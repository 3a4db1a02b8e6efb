"""runtime.call.CallView: the one view of a call the call-time paths (replay, padding-free, the
fused loss) share. Its keyword-only shortcut gives what binding gives."""

import inspect

import pytest
import torch
from fastlayers.patching.runtime.call import CallView


def _reference(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | None:
    """The arguments by name as signature.bind gives them, **kwargs spread; None where a call
    does not bind (or passes extra positional arguments)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    out = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        else:
            out[name] = value
    return out


def forward(input_ids, attention_mask=None, *, labels=None, **kwargs):  # an HF-like forward
    pass


def strict(a, /, b, *, c, d=1):  # positional-only and required keyword-only parameters
    pass


def variadic(x, *args, y=2):
    pass


CALLS = [
    (forward, (), {"input_ids": 1, "attention_mask": 2}),
    (forward, (), {"attention_mask": 2}),  # a required argument missing
    (forward, (), {"input_ids": 1, "other": 3}),  # through **kwargs
    (forward, (), {"input_ids": 1, "kwargs": 3}),  # the **kwargs parameter's own name
    (forward, (1, 2), {"labels": 3}),
    (strict, (), {"b": 1, "c": 2}),  # positional-only missing
    (strict, (), {"a": 0, "b": 1, "c": 2}),  # positional-only passed by name
    (strict, (0,), {"b": 1, "c": 2}),
    (strict, (0,), {"b": 1}),  # required keyword-only missing
    (variadic, (), {"x": 1, "y": 3}),
    (variadic, (1, 2), {}),
    (variadic, (), {"args": 1, "x": 2}),
]


@pytest.mark.parametrize("fn, args, kwargs", CALLS)
def test_bind_gives_what_binding_gives(fn, args, kwargs):
    signature = inspect.signature(fn)
    view = CallView.bind(signature, args, kwargs)
    expected = _reference(signature, args, kwargs)
    assert (view.arguments if view is not None else None) == expected


def test_the_mask_is_the_2d_attention_mask_by_name_or_place():
    signature = inspect.signature(forward)
    ids, mask = torch.ones(2, 3), torch.ones(2, 3)
    assert CallView.bind(signature, (ids, mask), {}).mask is mask
    assert CallView.bind(signature, (), {"input_ids": ids, "attention_mask": mask}).mask is mask
    assert CallView.bind(signature, (ids, mask[:, None, None]), {}).mask is None  # 4-D
