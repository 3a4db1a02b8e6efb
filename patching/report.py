"""PatchReport: what a patch swapped, where, and what it left alone and why."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
        return self.format()

    def format(self, details: bool = False) -> str:
        """The counts line, then the swaps and skips grouped by rule, what was replaced and
        where (layer indices folded into ``*``, with a count); ``details``: one row per
        module instead."""
        verb = "would swap" if self.dry_run else "swapped"
        counts = ", ".join(f"{rule}: {n}" for rule, n in sorted(self.counts().items()))
        lines = [
            f"fastlayers.patch: {verb} {self.num_swapped} modules ({counts or 'none'}), "
            f"skipped {self.num_skipped}"
        ]
        if self.swaps and details:
            rows = [[s.name, s.native, s.fused] for s in self.swaps]
            lines += ["", format_table(["module", "native", "fused"], rows)]
        elif self.swaps:
            groups = grouped(self.swaps, lambda s: (s.rule, s.native, s.fused))
            rows = [
                [rule, native, fused, str(n), where] for (rule, native, fused), n, where in groups
            ]
            lines += ["", format_table(["rule", "native", "fused", "count", "where"], rows)]
        if self.skips and details:
            rows = [[s.name, s.native, s.reason] for s in self.skips]
            lines += ["", format_table(["skipped module", "type", "reason"], rows)]
        elif self.skips:
            groups = grouped(self.skips, lambda s: (s.rule, s.native, s.reason))
            rows = [[rule, native, str(n), where, why] for (rule, native, why), n, where in groups]
            lines += ["", format_table(["rule", "skipped", "count", "where", "reason"], rows)]
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


def name_pattern(name: str) -> str:
    """``name`` with its numeric parts (layer indices) as ``*``: ``encoder.layer.*.output``."""
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", name)


def grouped_items(
    items: Iterable[Any], key: Callable[[Any], tuple]
) -> list[tuple[tuple, list, str]]:
    """(key, items, where) per distinct ``key(item)`` and name pattern of ``item.name`` (layer
    indices folded), in first-seen order; the groups of one key whose patterns differ in their
    last part only are one group (``layers.*.self_attn.{q_proj,k_proj,v_proj}``). ``where`` is
    the pattern, or the name itself when one item has it."""
    groups: dict[tuple, list[Any]] = {}
    for item in items:
        groups.setdefault((*key(item), name_pattern(item.name)), []).append(item)
    siblings: dict[tuple, list[tuple]] = {}  # (key, parent pattern) -> its groups' keys
    for k in groups:
        parent, dot, _ = k[-1].rpartition(".")
        siblings.setdefault((*k[:-1], parent if dot else None), []).append(k)
    out = []
    for (*k, parent), members in siblings.items():
        # one row only where every module holding one of them holds all of them (q, k and v of
        # each attention): not where one layer's q_proj was skipped, nor T5's self-attention
        # and cross-attention, which sit in different layers
        held: dict[str, set[str]] = defaultdict(set)
        for m in members:
            for item in groups[m]:
                parent_name, _, last = item.name.rpartition(".")
                held[parent_name].add(last)
        lasts = [m[-1].rpartition(".")[2] for m in members]
        if parent is None or len(members) == 1 or any(h != set(lasts) for h in held.values()):
            for m in members:
                names = groups[m]
                out.append((m[:-1], names, names[0].name if len(names) == 1 else m[-1]))
            continue
        everything = [item for m in members for item in groups[m]]
        base = next(iter(held)) if len(held) == 1 else parent
        out.append((tuple(k), everything, f"{base}.{{{','.join(lasts)}}}"))
    return out


def grouped(items: Iterable[Any], key: Callable[[Any], tuple]) -> list[tuple[tuple, int, str]]:
    """(key, count, where) per group of :func:`grouped_items`."""
    return [(k, len(members), where) for k, members, where in grouped_items(items, key)]
