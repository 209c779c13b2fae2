"""TRL's RL and preference trainers (GRPO, RLOO, DPO, KTO) as stacks the watch knows.

What they add to a Trainer: reward functions called between steps on generated completions (GRPO,
RLOO), and their own metrics in the Trainer's log (``reward``, ``frac_reward_zero_std``,
``completions/clipped_ratio``, ``rewards/margins``, ``logps/*``). :class:`RewardTap` wraps each
plain reward function so the watch sees what it returned (the values go back unchanged).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...introspect.trl import TAPPED, plain_reward_functions
from .instance_wrap import patch


@dataclass
class RewardCall:
    """One call of one reward function: its name, what it returned, and what it scored."""

    name: str
    values: list[float | None]
    completions: list[Any]
    completion_ids: list[list[int]] | None = None


def _float_or_none(value: Any) -> float | None:
    if value is None:
        return None  # TRL's "not applicable to this sample": it becomes NaN and nanmean skips it
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


class RewardTap:
    """Patches each synchronous, non-module reward function in ``trainer.reward_funcs`` (an item of the
    list, ``instance_wrap.patch``): it calls the function, hands its result back untouched, and passes a
    :class:`RewardCall` to ``sink``; nbguard's own failure goes to ``on_error``, never into TRL.

    The function the patch calls is kept in ``TAPPED`` on the wrapper and read at each call: a fix
    (finite-rewards) slips its wrapper in there, and removal leaves the fixed function in the list.
    Async functions and reward models (``nn.Module``) are left as they are: TRL dispatches on their
    type, and their rewards still reach the watch through the log.
    """

    def __init__(self, trainer: Any, sink: Callable[[RewardCall], None],
                 on_error: Callable[[BaseException], None]):
        self.trainer = trainer
        self.patches = [patch(trainer.reward_funcs, i, _observer(name, sink), on_error, slot=TAPPED)
                        for i, name, _ in plain_reward_functions(trainer)]

    @property
    def wrapped(self) -> int:
        return len(self.patches)

    def remove(self) -> None:
        for held in self.patches:
            held.remove()
        self.patches.clear()


def _observer(name: str, sink: Callable[[RewardCall], None]) -> Callable[..., Any]:
    def observe(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)  # the user's exceptions propagate unchanged
        # a sequence: TRL takes len() of it (a generator would fail there before reaching training)
        values = [_float_or_none(v) for v in result] if hasattr(result, "__len__") else []
        ids = kwargs.get("completion_ids")
        sink(RewardCall(name, values, list(kwargs.get("completions") or []),
                        [list(x) for x in ids] if isinstance(ids, list) else None))
        return result

    return observe
