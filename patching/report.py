"""PatchReport: what a patch swapped, where, and what it left alone and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fastlayers import config


@dataclass(frozen=True)
class Swap:
    """One replacement: ``name`` is the qualified module name in the model."""

    name: str
    native: str
    fused: str
    rule: str


@dataclass(frozen=True)
class Skip:
    """A module a rule looked at and left alone, with the reason."""

    name: str
    native: str
    rule: str
    reason: str


@dataclass
class PatchReport:
    """The result of :func:`fastlayers.patch`: each swap and each skip, with counts."""

    swaps: list[Swap] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    dry_run: bool = False

    @property
    def num_swapped(self) -> int:
        return len(self.swaps)

    @property
    def num_skipped(self) -> int:
        return len(self.skips)

    def counts(self) -> dict[str, int]:
        """Swaps per rule, e.g. ``{'layer_norm': 25, 'linear_gelu': 12}``."""
        return dict(Counter(s.rule for s in self.swaps))

    def skip_counts(self) -> dict[str, int]:
        """Skips per rule."""
        return dict(Counter(s.rule for s in self.skips))

    def __str__(self) -> str:
        verb = "would swap" if self.dry_run else "swapped"
        counts = ", ".join(f"{rule}: {n}" for rule, n in sorted(self.counts().items()))
        lines = [
            f"fastlayers.patch: {verb} {self.num_swapped} modules ({counts or 'none'}), "
            f"skipped {self.num_skipped}"
        ]
        if self.swaps:
            lines += [
                "",
                format_table(
                    ["module", "native", "fused"], [[s.name, s.native, s.fused] for s in self.swaps]
                ),
            ]
        if self.skips:
            lines += [
                "",
                format_table(
                    ["skipped module", "type", "reason"],
                    [[s.name, s.native, s.reason] for s in self.skips],
                ),
            ]
        note = self.compile_note()
        if note:
            lines += ["", note]
        return "\n".join(lines)

    def compile_note(self) -> str | None:
        """What torch.compile will run for the swapped LayerNorms and rewritten blocks, when it
        is not our kernels."""
        counts, notes = self.counts(), []
        if "layer_norm" in counts and config.compile_layer_norm == "inductor":
            notes.append(
                "note: under torch.compile the LayerNorms trace as aten.layer_norm, so Inductor "
                "fuses them with their neighbours (faster in a compiled model); "
                "fastlayers.config.set_compile_layer_norm('fused') keeps fastlayers' kernel there"
            )
        if "residual_layer_norm" in counts and config.compile_residual_layer_norm == "inductor":
            notes.append(
                "note: under torch.compile the blocks rewritten for dropout + add + LayerNorm "
                "trace their original forward (Inductor fuses it itself; an MLP in the same block "
                "then computes natively too); "
                "fastlayers.config.set_compile_residual_layer_norm('fused') keeps the fused ops"
            )
        return "\n".join(notes) or None


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns under a header and a dashed rule."""
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        + [fmt.format(*r) for r in rows]
    )
