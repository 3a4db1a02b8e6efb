"""The unit of patching: a rewrite record. Each applied change to a model (a module swap, a block
forward rewrite) is one record that can apply and undo itself, describe itself for the report and
give fastlayers.check its native reference. patch plans records, unpatch / natives_restored /
check iterate them; nothing else matches module types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .report import Swap


@dataclass(frozen=True)
class CheckTarget:
    """What fastlayers.check compares for one record: ``module``'s output against ``native``
    called on the same inputs (both in the model's dtype), and against ``reference``, a float64
    version of native, or None when float64 is not available for it."""

    name: str
    module: nn.Module
    native: Callable[..., object]
    reference: Callable[[], Callable[..., object]] | None
    fused: str


class Rewrite:
    """One planned change to a model: it can apply itself, undo itself (the model exactly as
    before: the same module objects, Parameters and hooks), and describe itself for the report.
    Planning a rewrite never changes the model; :func:`patch` applies all or none."""

    rule: str = ""

    def apply(self) -> None:
        raise NotImplementedError

    def undo(self) -> None:
        raise NotImplementedError

    def describe(self) -> list[Swap]:
        """The report's rows (none for a rewrite the report does not list)."""
        return []

    def undo_problem(self) -> str | None:
        """Why :meth:`undo` could not give the model back as it runs now (unpatch refuses then,
        before undoing anything), or None."""
        return None

    def restored_modules(self) -> int:
        """How many native modules (or forwards) undo puts back (unpatch's count)."""
        return 0

    def check_targets(self) -> list[CheckTarget] | str:
        """What fastlayers.check compares for this rewrite, or why it cannot compare it."""
        return []
