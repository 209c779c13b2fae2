"""Which fixes to try for a watch event (by its cause) or a finding (its own fix ids), with options."""
from __future__ import annotations

from typing import Any

import torch

from .. import fixes
from ..findings import FixOffer
from ..fixes.registry import CAUSE_FIXES  # cause -> fixes, read off each fix's own `treats`
from ..introspect.quantization import four_bit_layers
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


def for_event(event: Any, step: CapturedStep, hardware: Any = None) -> list[FixOffer]:
    """The fixes for the event's cause that fit this run: none that only changes TrainingArguments in a plain loop
    (``step.args`` None), and none that already holds (a loop that clips at max_norm <= 1 gets no clipping fix)."""
    offers = with_options(list(CAUSE_FIXES.get(event.cause or "", [])), step, hardware=hardware)
    return [offer for offer in offers if fits_run(offer, step)]


def fits_run(offer: FixOffer, step: CapturedStep) -> bool:
    fix = fixes.get(offer.id)
    if step.args is None and fix.needs == "args":  # a loop has no TrainingArguments for the cell to change
        return False
    return fix.holds is None or fix.holds(step, **offer.options) is None
