"""The one registry of the patcher's rules: every rule, in the order the report lists them, each
declared in a file of its own here (what it matches, what record it makes; base.py says what
the kinds of rule are)."""

from __future__ import annotations

from .base import BlockRule, Found, HeadLossRule, Match, ModuleRule, PairRule, RouteRule
from .gated_mlp import GATED_MLP
from .layer_norm import LAYER_NORM
from .linear_cross_entropy import LINEAR_CROSS_ENTROPY
from .linear_gelu import LINEAR_GELU
from .linear_relu import LINEAR_RELU
from .mlp import MLP
from .relu import RELU
from .relu_scale import RELU_SCALE
from .residual_layer_norm import RESIDUAL_LAYER_NORM
from .residual_rms_norm import RESIDUAL_RMS_NORM
from .rms_norm import RMS_NORM
from .rotary import ROTARY
from .shared_input_linear import SHARED_INPUT_LINEAR
from .varlen_attention import VARLEN_ATTENTION

MODULE_RULES: tuple[ModuleRule, ...] = (RMS_NORM, LAYER_NORM, RELU, SHARED_INPUT_LINEAR)
PAIR_RULES: tuple[PairRule, ...] = (LINEAR_GELU, LINEAR_RELU)
BLOCK_RULES: tuple[BlockRule, ...] = (
    RESIDUAL_LAYER_NORM,
    RESIDUAL_RMS_NORM,
    RELU_SCALE,
    MLP,
    GATED_MLP,
)
ROUTE_RULES: tuple[RouteRule, ...] = (ROTARY, VARLEN_ATTENTION)
HEAD_LOSS_RULES: tuple[HeadLossRule, ...] = (LINEAR_CROSS_ENTROPY,)

ALL_LAYERS = tuple(
    sorted(
        r.name for r in (*MODULE_RULES, *PAIR_RULES, *BLOCK_RULES, *ROUTE_RULES, *HEAD_LOSS_RULES)
    )
)
# What patch() and check() apply unless told otherwise: every rule but 'relu' (rules/relu.py
# says why).
DEFAULT_LAYERS = tuple(name for name in ALL_LAYERS if name not in (RELU.name,))


def pair_rule(kind: str | None) -> PairRule | None:
    """The pair rule that fuses an activation of this kind ('gelu', 'gelu_tanh', 'relu'), or
    None."""
    return next((r for r in PAIR_RULES if kind in r.activations), None)


def block_rules(names: tuple[str, ...] | list[str]) -> list[BlockRule]:
    """The block rules of these names, in registry order."""
    wanted = set(names)
    return [r for r in BLOCK_RULES if r.name in wanted]


__all__ = [
    "ALL_LAYERS",
    "BLOCK_RULES",
    "DEFAULT_LAYERS",
    "HEAD_LOSS_RULES",
    "LINEAR_CROSS_ENTROPY",
    "MODULE_RULES",
    "PAIR_RULES",
    "ROUTE_RULES",
    "VARLEN_ATTENTION",
    "BlockRule",
    "Found",
    "HeadLossRule",
    "Match",
    "ModuleRule",
    "PairRule",
    "RouteRule",
    "block_rules",
    "pair_rule",
]
