"""The divergence test of the step in flight, on the device (``WatchSettings(read="deferred")``, issue 45).

Read a step late, an exploded update would be applied before the host hears of it. The run's baseline
(its level, noise, recent losses) is already on the host, judged up to the step before; only the step in
flight's own total norm and loss are on the device. So the host hands the bounds over as numbers
(``DivergenceDetector.bounds``) and the comparison is a few tensor ops: no host read, and the same
judgement ``DivergenceDetector.update`` makes of the step a step later (the two agree but for rounding
at the bound itself: fp32 here, fp64 there). A climb and a dead run span many steps: they stay late.
"""
from __future__ import annotations

import torch

from .divergence import JumpBounds


def explodes_on_device(total: torch.Tensor, loss: torch.Tensor | None, bounds: JumpBounds) -> torch.Tensor | None:
    """A 0-d bool tensor: does a step with this total gradient norm and loss (0-d fp32 device tensors) start
    an explosion? None where nothing could fire yet. A norm of 0 or a non-finite one never does (others judge
    those)."""
    b, s = bounds, bounds.settings
    value = torch.log10(total)  # -inf for 0: every comparison below is False
    fired: list[torch.Tensor] = []
    if b.level is not None and b.limit is not None and b.limit_falling is not None:
        above = value - b.level
        if loss is not None and b.loss_median is not None:
            falling = loss < b.loss_median  # the run is still learning: a jump must be larger
            fired.append(above > torch.where(falling, b.limit_falling, b.limit))
        else:
            fired.append(above > b.limit)
        if b.rising is not None and loss is not None and b.loss_median is not None and b.loss_median > 0:
            fired.append((above > b.rising) & (loss > s.rising_loss_factor * b.loss_median))
    if b.ramp is not None and loss is not None:
        low, low_loss = b.ramp
        fired.append((value - low >= s.ramp_decades) & (loss >= s.ramp_loss_factor * low_loss))
    if not fired:
        return None
    verdict = fired[0]
    for more in fired[1:]:
        verdict = verdict | more
    return verdict & torch.isfinite(value)
