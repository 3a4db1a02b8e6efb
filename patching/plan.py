"""patch, unpatch and swap_children (usable as ``model.apply``): the walk over a model. Each
module's children are planned by the registry's rules (rules/: block rules first, one trace of
the block serving them all; then pair rules; then module rules), each candidate asked of
eligibility.py, each change a record (records.py); then all records are applied, or none.
unpatch finds the records on the model itself and undoes them."""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

from fastlayers.layers.recognise import probe_cache

from .blocks import claimed_children, plan_block
from .discover import find_linear_act, might_hold_pattern
from .eligibility import (
    foreign_kind,
    fusable_activation,
    linear_skip,
    module_rule_skip,
)
from .forms import join
from .fused import (
    FusedAway,
    forward_signature,
    fused_loss_forward,
    is_fused,
    native_of,
    replay_forward,
    rewritten_forward,
    unpad_forward,
)
from .records import (
    _MISSING,
    BlockRewrite,
    BuiltFused,
    ChildSwap,
    FusedLossRecord,
    InitWeightsForFused,
    LinearActSwap,
    ReplayRecord,
    Rewrite,
    UnpadRecord,
    _FusedAwareInit,
)
from .report import PatchReport, Skip
from .routes import plan_route
from .rules import (
    ALL_LAYERS,
    BLOCK_RULES,
    DEFAULT_LAYERS,
    LINEAR_CROSS_ENTROPY,
    MODULE_RULES,
    PAIR_RULES,
    ROUTE_RULES,
    VARLEN_ATTENTION,
    PairRule,
    pair_rule,
)
from .runtime.fused_loss import FusedLossForward
from .runtime.replay import ReplayForward, ReplayOptions
from .runtime.unpad import UnpadForward


def _check_layers(layers: str | Iterable[str] | None) -> tuple[str, ...]:
    """``layers`` as a tuple of rule names (one name alone is taken as that rule; None is the
    default set, rules.DEFAULT_LAYERS)."""
    if layers is None:
        return DEFAULT_LAYERS
    if not isinstance(layers, (str, Iterable)):
        raise TypeError(
            f"fastlayers.patch: layers must be a rule name, a sequence of them or None (the "
            f"default set), got {type(layers).__name__}"
        )
    layers = (layers,) if isinstance(layers, str) else tuple(layers)
    unknown = [name for name in layers if not isinstance(name, str) or name not in ALL_LAYERS]
    if unknown:
        raise ValueError(
            f"fastlayers.patch: unknown layers {unknown}; layers is a rule name or a sequence of "
            f"them, from {ALL_LAYERS}"
        )
    return layers


def _is_pretrained_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _plan_children(
    module: nn.Module, layers: tuple[str, ...], report: PatchReport, prefix: str
) -> list[Rewrite]:
    """The rewrites of ``module``'s direct children; skips go to ``report``. Changes nothing."""
    plan: list[Rewrite] = []
    claimed: set[str] = set()  # a child taken by one rule is not looked at by another
    existing = rewritten_forward(module)
    if existing is not None:  # rewritten by an earlier patch: its children stay claimed
        claimed.update(claimed_children(existing.matches))
    block_rules = [rule.name for rule in BLOCK_RULES if rule.name in layers]
    if block_rules:  # one trace of the block serves every enabled block rule
        forward, skips = plan_block(module, prefix, block_rules)
        report.skips += [
            Skip(name or "(root)", type(module).__name__, rule, why) for name, rule, why in skips
        ]
        if forward is not None:
            block = BlockRewrite(module, prefix, forward.matches, forward)
            claimed.update(block.claims())
            plan.append(block)
    route_rules = [rule.name for rule in ROUTE_RULES if rule.name in layers]
    if route_rules and not any(isinstance(r, BlockRewrite) for r in plan):
        routed, skips = plan_route(module, prefix, route_rules)
        report.skips += [
            Skip(name or "(root)", type(module).__name__, rule, why) for name, rule, why in skips
        ]
        if routed is not None:
            plan.append(BlockRewrite(module, prefix, routed.matches, routed))
    pair_rules = [r for r in PAIR_RULES if r.name in layers]
    if pair_rules and might_hold_pattern(module):
        for record in _plan_linear_act(module, pair_rules, report, prefix, claimed):
            claimed.update((record.linear.attr, record.activation.attr))
            plan.append(record)
    among = {
        rule.name: rule.among(module, claimed)
        for rule in MODULE_RULES
        if rule.among is not None and rule.name in layers
    }
    for name, child in list(module.named_children()):
        if name in claimed:
            continue
        for rule in MODULE_RULES:
            if rule.name not in layers or (rule.name in among and name not in among[rule.name]):
                continue
            qualified = join(prefix, name)
            target, why = rule.takes(child)
            if target:  # the first rule that targets a child decides it
                why = why or module_rule_skip(child)
                if why is not None:
                    report.skips.append(Skip(qualified, type(child).__name__, rule.name, why))
                    break
                fused = rule.build(child)
                plan.append(ChildSwap(module, name, child, fused, rule=rule.name, name=qualified))
                break
            if why is not None:
                report.skips.append(Skip(qualified, type(child).__name__, rule.name, why))
    return plan


def _plan_linear_act(
    module: nn.Module,
    rules: list[PairRule],
    report: PatchReport,
    prefix: str,
    claimed: set[str],
) -> list[LinearActSwap]:
    """The Linear + activation pairs among ``module``'s children that the selected pair
    ``rules`` fuse; the others are reported skipped. Pairs with a child ``claimed`` by a block
    rewrite are left to it. Each activation is recognised once (after its hooks are checked),
    and the Linear only looked at when the activation's rule runs."""
    pairs, why_not = find_linear_act(module)
    if why_not is not None:
        report.skips.append(Skip(prefix or "(root)", type(module).__name__, rules[0].name, why_not))
        return []
    plan = []
    for pair in pairs:
        linear, act = getattr(module, pair.linear), getattr(module, pair.activation)
        name = join(prefix, pair.linear)
        if is_fused(linear) or is_fused(act) or {pair.linear, pair.activation} & claimed:
            continue
        kind, why = fusable_activation(act)
        rule = pair_rule(kind)
        if why is None and rule not in rules:
            why = _unselected(act, rule, rules)
        why = why or pair.unproven or linear_skip(linear)
        if why is not None:
            shown = rule.name if rule in rules else rules[0].name
            report.skips.append(Skip(name, type(linear).__name__, shown, why))
            continue
        fused = rule.build(linear, kind)
        away = FusedAway(act, fused)
        plan.append(
            LinearActSwap(
                ChildSwap(module, pair.linear, linear, fused, rule=rule.name, name=name),
                ChildSwap(module, pair.activation, act, away, adopted=True),
                rule.name,
            )
        )
    return plan


def _unselected(act: nn.Module, rule: PairRule | None, rules: list[PairRule]) -> str:
    """The skip reason for an activation whose kind no selected rule fuses."""
    wanted = " or ".join(r.what for r in rules)
    text = f"{type(act).__name__} is not {wanted}"
    if rule is None:  # recognised, but no pair rule takes its kind
        return text
    return f"{text}: it computes {rule.what}, and rule {rule.name!r} is not in layers"


def _apply_all(plan: list[Rewrite]) -> None:
    """Apply every rewrite, or, if one raises, undo the applied ones (and the failing one's
    partial work) in reverse and re-raise: the model is then exactly as before."""
    done: list[Rewrite] = []
    try:
        for record in plan:
            done.append(record)  # before apply: undo also cleans up a half-applied record
            record.apply()
    except BaseException:
        for record in reversed(done):
            record.undo()
        raise


def _finish(plan: list[Rewrite], report: PatchReport, dry_run: bool) -> PatchReport:
    if not dry_run:
        _apply_all(plan)
    report.swaps.extend(row for r in plan for row in r.describe())
    return report


def swap_children(
    module: nn.Module,
    *,
    layers: str | Iterable[str] = DEFAULT_LAYERS,
    dry_run: bool = False,
    report: PatchReport | None = None,
    prefix: str = "",
) -> PatchReport:
    """Swap the direct children of ``module`` for fused layers, in place (all or none); safe to
    pass to ``model.apply``. Returns (and extends, when given) a :class:`PatchReport` whose
    names are relative to ``module`` unless ``prefix`` names it."""
    layers = _check_layers(layers)
    report = report if report is not None else PatchReport(dry_run=dry_run)
    with probe_cache():
        plan = _plan_children(module, layers, report, prefix)
    return _finish(plan, report, dry_run)


def patch(
    model: nn.Module,
    *,
    layers: str | Iterable[str] = DEFAULT_LAYERS,
    dry_run: bool = False,
    replay: bool | ReplayOptions = False,
    unpad: bool = False,
) -> PatchReport:
    """Swap fused layers into ``model`` in place and return a :class:`PatchReport` of what was
    swapped where, and what was skipped and why. ``layers`` picks rules (rules.ALL_LAYERS; the
    default, rules.DEFAULT_LAYERS, is all of them but 'relu'; one name alone is that rule):

    - 'layer_norm', 'relu': ``nn.LayerNorm`` / ``nn.ReLU`` swapped one for one (LayerNorm,
      ReLUScale); 'relu' only when named: a bare ReLU gains nothing from ReLUScale(1);
    - 'linear_gelu', 'linear_relu': an ``nn.Linear`` (or a subclass whose forward computes
      F.linear, or HuggingFace ``Conv1D``) whose output goes only to a GELU / ReLU module becomes
      a FusedLinearGELU / FusedLinearReLU, the activation an identity (FusedAway);
    - 'residual_layer_norm', 'relu_scale', 'mlp': block rewrites (a block whose own forward
      computes ``layer_norm(dropout(x) + residual)``, ``relu(x) * c``, or Linear -> GELU / ReLU
      -> Linear, runs the fused op; see patching/blocks.py); a Linear taken by 'mlp' is not also
      fused with its activation by 'linear_gelu' / 'linear_relu';
    - 'rotary', 'varlen_attention': routes (patching/routes.py): an attention's
      ``apply_rotary_pos_emb`` runs the fused rotary op; its attention function runs on CUDA
      without cuDNN's per-shape plan build until a shape repeats enough to pay for one
      (runtime.varlen.cudnn_plan_pays), and serves padding-free calls;
    - 'shared_input_linear': the ``nn.Linear`` children a block's forward calls with one and the
      same local name (an attention's q, k and v) become SharedInputLinear: under autocast one
      conversion of their float32 input and one kept copy, native's results bit for bit.

    ``unpad=True``: padding-free execution (patching/runtime/unpad.py): a call of the model's
    base model (``model.base_model``: BertModel, LlamaModel, ...) with a 2-D attention mask runs
    on its real tokens only, attention per sequence (rule 'varlen_attention', added to
    ``layers`` where they leave it out), outputs in the caller's shapes with zeros at the
    padding; checked against the padded model on its first call.

    ``replay`` (True, or a :class:`ReplayOptions`): inference calls under ``torch.no_grad()``
    on CUDA replay the model's forward from CUDA graphs captured per shape bucket (see
    patching/replay.py; ``layers=()`` replays an unpatched model). ``dry_run`` reports without
    changing anything. Patching twice changes nothing the second time.

    All or nothing: every rewrite is planned first, then applied; if one raises, the applied
    ones are undone and the model is exactly as before. Adapter-wrapped (PEFT/LoRA) and
    quantized modules are left native, with a warning naming them."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastlayers.patch: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(replay, (bool, ReplayOptions)):
        raise TypeError(
            f"fastlayers.patch: replay must be True, False or a ReplayOptions, got "
            f"{type(replay).__name__}"
        )
    if not isinstance(unpad, bool):
        raise TypeError(
            f"fastlayers.patch: unpad must be True or False, got {type(unpad).__name__}"
        )
    layers = _check_layers(layers)
    if unpad and VARLEN_ATTENTION.name not in layers:
        layers = (*layers, VARLEN_ATTENTION.name)
    _warn_foreign(model)
    report = PatchReport(dry_run=dry_run)
    plan: list[Rewrite] = []
    with probe_cache():
        report.skips += _root_skips(model, layers)
        for name, module in list(model.named_modules()):
            if is_fused(module):
                continue
            plan += _plan_children(module, layers, report, name)
    if any(isinstance(r, (LinearActSwap, ChildSwap)) for r in plan):
        plan += [
            InitWeightsForFused(m)
            for m in model.modules()
            if _is_pretrained_model(m)
            and not isinstance(m.__dict__.get("_init_weights"), _FusedAwareInit)
        ]
    if LINEAR_CROSS_ENTROPY.name in layers:
        plan += _plan_fused_loss(model, report)
    options = replay if isinstance(replay, ReplayOptions) else ReplayOptions()
    if unpad:
        plan += _plan_unpad(model, report, options if replay is not False else None)
    if replay is not False and replay_forward(model) is None:
        why = _replay_refusal(model) or (
            "the padding-free base model replays its packed calls itself (graphs keyed by "
            "packed size)"
            if unpad or any(unpad_forward(m) for m in model.modules())
            else None
        )
        if why is None:
            plan.append(ReplayRecord(model, ReplayForward(model, None, options)))
        else:
            report.skips.append(Skip("(root)", type(model).__name__, "replay", why))
    return _finish(plan, report, dry_run)


def _plan_fused_loss(model: nn.Module, report: PatchReport) -> list[Rewrite]:
    """The fused head + loss forwards for the causal LMs in ``model`` (rule
    'linear_cross_entropy'); a causal LM the rule refuses is reported skipped with the reason."""
    plan: list[Rewrite] = []
    for name, module in model.named_modules():
        if fused_loss_forward(module) is not None or is_fused(module):
            continue
        match, why = LINEAR_CROSS_ENTROPY.find(module)
        if match is None and why is None:
            continue
        why = why or _replay_refusal(module)  # what any call-time path on a forward needs
        if why is not None:
            where = name or "(root)"
            report.skips.append(Skip(where, type(module).__name__, LINEAR_CROSS_ENTROPY.name, why))
            continue
        loss = FusedLossForward(module, None, match.head, match.softcap)
        plan.append(FusedLossRecord(module, loss, name))
    return plan


def _plan_unpad(
    model: nn.Module, report: PatchReport, replay: ReplayOptions | None
) -> list[Rewrite]:
    """The padding-free forwards for ``model``: one per outermost transformers model, on its base
    model (replaying its packed calls where ``replay`` is given); what cannot be one is reported
    skipped."""
    plan: list[Rewrite] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if not _is_pretrained_model(module) or any(
            o == "" or name.startswith(f"{o}.") for o in inside
        ):
            continue
        inside.append(name)
        base = getattr(module, "base_model", module)
        base_name = next((n for n, m in model.named_modules() if m is base), name)
        why = _unpad_refusal(base)
        if why is not None:
            report.skips.append(Skip(base_name or "(root)", type(base).__name__, "unpad", why))
        elif unpad_forward(base) is None:
            plan.append(UnpadRecord(base, UnpadForward(base, None, replay), base_name))
    if not inside:
        report.skips.append(
            Skip("(root)", type(model).__name__, "unpad", "no transformers model in it")
        )
    return plan


def _unpad_refusal(base: nn.Module) -> str | None:
    """Why a base model cannot run padding-free calls, or None."""
    why = _replay_refusal(base)
    if why is not None:
        return why
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return "an encoder-decoder model (its decoder attends to another sequence)"
    signature = forward_signature(base)
    params = signature.parameters if signature is not None else {}
    if "attention_mask" not in params or "position_ids" not in params:
        return "its forward takes no attention_mask and position_ids"
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "its forward passes no keyword arguments on to its attention (no **kwargs)"
    return None


def _replay_refusal(model: nn.Module) -> str | None:
    """Why replay (or another call-time path: padding-free, the fused loss) cannot wrap
    ``model``'s forward, or None."""
    if not isinstance(getattr(type(model), "forward", None), types.FunctionType):
        return "its class has no Python forward to wrap"
    if "_hf_hook" in model.__dict__:
        return "it has an accelerate hook (offloaded weights move on every call)"
    forward = model.__dict__.get("forward")
    if forward is not None and rewritten_forward(model) is None and not fused_loss_forward(model):
        return "its forward was replaced on the instance"
    return None


def _root_skips(model: nn.Module, layers: tuple[str, ...]) -> list[Skip]:
    """The model itself as a module rule's target (an nn.LayerNorm, or a module the rule
    recognises, such as a model's own RMSNorm): a patch swaps children in place, and cannot
    replace the object the caller holds; a target the rule refuses gets the rule's reason."""
    skips = []
    for rule in MODULE_RULES:
        if rule.name not in layers or rule.among is not None or is_fused(model):
            continue
        target, why = rule.takes(model)
        if not target:
            continue
        why = why or module_rule_skip(model)
        if why is None:
            why = (
                "the model itself is the module to swap; patch replaces a model's children in "
                "place, so wrap it in a container, or build the fused layer directly: "
                f"{rule.fused}"
            )
        skips.append(Skip("(root)", type(model).__name__, rule.name, why))
        break  # the first rule that targets a module decides it, as for children
    return skips


def _warn_foreign(model: nn.Module) -> None:
    """One warning naming the adapter-wrapped and quantized modules (outermost only)."""
    found: dict[str, list[str]] = {}
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in inside):
            continue
        kind = foreign_kind(module)
        if kind is not None:
            found.setdefault(kind, []).append(name or "(root)")
            inside.append(name)
    if not found:
        return
    parts = []
    for kind, names in found.items():
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{len(names)} {kind} ({shown})")
    warnings.warn(
        f"fastlayers.patch: {'; '.join(parts)} left native. Apply LoRA/quantization before "
        "patch() (as here) or unpatch() first: tools run after a patch do not see fused "
        "Linears as nn.Linear",
        UserWarning,
        stacklevel=3,
    )


def applied_rewrites(model: nn.Module) -> list[Rewrite]:
    """The rewrites a patch applied to ``model``, and the fused layers built into it directly,
    found on the model itself (so they survive deepcopy and pickling), in the order they can be
    undone."""
    records: list[Rewrite] = []
    replayed = replay_forward(model)
    if replayed is not None:  # first: it wraps the root's forward
        records.append(ReplayRecord(model, replayed))
    for prefix, module in list(model.named_modules()):
        loss = fused_loss_forward(module)
        if loss is not None:  # under replay's, over unpad's and a block rewrite's
            records.append(FusedLossRecord(module, loss, prefix))
        unpadded = unpad_forward(module)
        if unpadded is not None:  # before the block rewrite it may wrap
            records.append(UnpadRecord(module, unpadded, prefix))
        forward = rewritten_forward(module)
        if forward is not None:
            records.append(BlockRewrite(module, prefix, forward.matches, forward))
        children = dict(module.named_children())
        attr_of = {id(c): name for name, c in children.items()}
        paired = {id(c.into) for c in children.values() if isinstance(c, FusedAway)}
        for name, child in children.items():
            native, qualified = native_of(child), join(prefix, name)
            if isinstance(child, FusedAway):
                linear = attr_of.get(id(child.into))
                if linear is not None:
                    records.append(
                        LinearActSwap(
                            ChildSwap(
                                module,
                                linear,
                                native_of(child.into),
                                child.into,
                                name=join(prefix, linear),
                                adopted=True,
                            ),
                            ChildSwap(module, name, native, child, adopted=True),
                            _pair_rule_of(child.into),
                        )
                    )
                    continue
            if id(child) in paired:
                continue  # recorded with its FusedAway
            if native is not None:
                records.append(ChildSwap(module, name, native, child, name=qualified, adopted=True))
            elif is_fused(child) and not isinstance(child, FusedAway):
                records.append(BuiltFused(qualified, child))
        if isinstance(module.__dict__.get("_init_weights"), _FusedAwareInit):
            record = InitWeightsForFused(module)
            record.previous = module.__dict__["_init_weights"].previous or _MISSING
            records.append(record)
    return records


def _pair_rule_of(fused: nn.Module) -> str:
    """The pair rule that built ``fused`` (a FusedLinearAct), from its activation."""
    rule = pair_rule(fused.activation)
    return rule.name if rule is not None else ""


def unpatch(model: nn.Module) -> int:
    """Put the native modules back (the very objects that were swapped out, re-bound to the
    fused modules' current Parameters, so loading or moving after the patch carries over).
    Returns how many modules were restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fastlayers.unpatch: model must be an nn.Module, got {type(model).__name__}"
        )
    records = applied_rewrites(model)
    problems = [p for p in (r.undo_problem() for r in records) if p is not None]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"fastlayers.unpatch: cannot hand the model back: {problems[0]}{more}")
    for record in records:
        record.undo()
    return sum(r.restored_modules() for r in records)


@contextmanager
def natives_restored(model: nn.Module) -> Iterator[None]:
    """For the duration, the model runs its native modules (the objects unpatch would put
    back); the very same fused modules return afterwards."""
    records = applied_rewrites(model)
    for record in records:
        record.undo()
    try:
        yield
    finally:
        for record in reversed(records):
            record.apply()
