"""Which fixes to try for a watch event (by its cause) or a finding (its own fix ids), with options."""
from __future__ import annotations

from typing import Any

import torch

from .. import fixes
from ..findings import FixOffer
from ..fixes.parts import missing_part
from ..fixes.registry import CAUSE_FIXES, LOOP_HOLDS, TRAINER_HOLDS, Target  # CAUSE_FIXES: read off fixes' `treats`
from ..introspect.optimizers import eps_underflows
from ..introspect.quantization import four_bit_layers
from ..session import SESSION
from ..step.plan import CapturedStep


def uses_fp16(step: CapturedStep) -> bool:
    """The step ran in fp16 somewhere: its autocast, its weights, or a 4-bit layer's compute dtype."""
    captured = step.micro_batches[0].autocast if step.micro_batches else []
    return any(t == torch.float16 for _, t in captured) or any(
        p.dtype == torch.float16 for p in step.eager.parameters()) or any(
        m.compute_dtype == torch.float16 for _, m in four_bit_layers(step.eager))


def with_options(fix_ids: list[str], step: CapturedStep, options: dict[str, dict[str, Any]] | None = None,
                 hardware: Any = None) -> list[FixOffer]:
    options = options or {}
    return [FixOffer(fix_id, {**fixes.get(fix_id).options_for(hardware, uses_fp16(step)), **options.get(fix_id, {})})
            for fix_id in fix_ids]


# audit rules whose finding predicts a watch event: the causes it predicts. Their fixes come first among that
# event's candidates (the audit said "Adam's eps=1e-08 is 0.0 in float16: the weights will become inf", and they did)
PREDICTED_CAUSES = {"adam-eps-underflow": ("nonfinite-parameter", "overflow", "invalid-op")}


def predicted_fixes(cause: str | None, optimizer: Any = None) -> list[str]:
    """The fixes of the audit findings that predicted an event of ``cause``: the last audit's, and the
    adam-eps-underflow rule's own check on the run's optimizer where no audit ran with it."""
    audit = SESSION.last_audit
    found = [fix for f in getattr(audit, "findings", None) or []
             if cause in PREDICTED_CAUSES.get(f.rule, ()) for fix in f.fixes]
    if optimizer is not None and cause in PREDICTED_CAUSES["adam-eps-underflow"] and eps_underflows(optimizer):
        found += EPS_FIXES
    return list(dict.fromkeys(f for f in found if f in fixes.FIXES))


EPS_FIXES = ["optimizer-eps-for-dtype", "upcast-trainable-fp32"]  # the adam-eps-underflow finding's, in its order


def event_fix_ids(event: Any, optimizer: Any = None) -> list[str]:
    """The fixes tried for a watch event: what the audit predicted for it first, then those its cause offers."""
    return list(dict.fromkeys([*predicted_fixes(event.cause, optimizer), *CAUSE_FIXES.get(event.cause or "", [])]))


def for_event(event: Any, step: CapturedStep, hardware: Any = None, optimizer: Any = None) -> list[FixOffer]:
    """The fixes for the event (``event_fix_ids``) that fit this run: none that only changes TrainingArguments
    or a Trainer in a plain loop (``step.args`` None), none for a part the model lacks (no embeddings to
    initialise), and none that already holds (a loop that clips at max_norm <= 1 gets no clipping fix)."""
    offers = with_options(event_fix_ids(event, optimizer), step, hardware=hardware)
    return [offer for offer in offers if fits_run(offer, step, optimizer)]


def applies(fix_id: str, step: CapturedStep, optimizer: Any = None) -> bool:
    """Whether the fix has something to act on in this run: a plain loop (``step.args`` None) has no Trainer and
    no TrainingArguments (its data fixes filter ``trainer.train_dataset``: neither their action nor their cell
    fits a loop), and a model without embeddings (dropout, MoE routers, ...) has nothing for their fixes to
    change."""
    fix = fixes.get(fix_id)
    if not fix.reached_by(TRAINER_HOLDS if step.args is not None else LOOP_HOLDS):
        return False
    return missing_part(fix, Target(model=step.eager, args=step.args, optimizer=optimizer)) is None


def fits_run(offer: FixOffer, step: CapturedStep, optimizer: Any = None) -> bool:
    """``applies``, and the run does not already do what the fix would (``Fix.holds``)."""
    fix = fixes.get(offer.id)
    return applies(offer.id, step, optimizer) and (fix.holds is None or fix.holds(step, **offer.options) is None)
