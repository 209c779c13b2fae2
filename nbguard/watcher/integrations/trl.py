"""TRL's RL and preference trainers (GRPO, RLOO, DPO, KTO) as stacks the watch knows.

What they add to a Trainer: reward functions called between steps on generated completions (GRPO,
RLOO), and their own metrics in the Trainer's log (``reward``, ``frac_reward_zero_std``,
``completions/clipped_ratio``, ``rewards/margins``, ``logps/*``). :class:`RewardTap` wraps each
plain reward function so the watch sees what it returned (the values go back unchanged).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...introspect.trl import TAPPED, plain_reward_functions


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
    """Replaces each synchronous, non-module reward function in ``trainer.reward_funcs`` by a wrapper
    that calls it, hands its result back untouched, and passes a :class:`RewardCall` to ``sink``.

    ``sink`` is guarded by the caller; the wrapper never lets nbguard's own failure reach the
    trainer (``on_error``). Async functions and reward models (``nn.Module``) are left as they are:
    TRL dispatches on their type, and their rewards still reach the watch through the log.
    """

    def __init__(self, trainer: Any, sink: Callable[[RewardCall], None],
                 on_error: Callable[[BaseException], None]):
        self.trainer = trainer
        self.wrappers: list[tuple[int, Any]] = []
        funcs = trainer.reward_funcs
        for i, name, func in plain_reward_functions(trainer):
            if hasattr(func, TAPPED):
                continue  # already tapped by another watch
            funcs[i] = _wrap(func, name, sink, on_error)
            self.wrappers.append((i, funcs[i]))

    @property
    def wrapped(self) -> int:
        return len(self.wrappers)

    def remove(self) -> None:
        funcs = getattr(self.trainer, "reward_funcs", None)
        for i, wrapper in self.wrappers:
            if isinstance(funcs, list) and i < len(funcs) and funcs[i] is wrapper:
                funcs[i] = getattr(wrapper, TAPPED)  # the function, with any fix applied under the tap since
        self.wrappers.clear()


def _wrap(func: Callable, name: str, sink: Callable[[RewardCall], None],
          on_error: Callable[[BaseException], None]) -> Callable:
    @functools.wraps(func)
    def reward(*args: Any, **kwargs: Any) -> Any:
        # looked up at each call: a fix (finite-rewards) may have been slipped in under the tap
        result = getattr(reward, TAPPED)(*args, **kwargs)  # the user's exceptions propagate unchanged
        try:
            # a sequence: TRL takes len() of it (a generator would fail there before reaching training)
            values = [_float_or_none(v) for v in result] if hasattr(result, "__len__") else []
            ids = kwargs.get("completion_ids")
            sink(RewardCall(name, values, list(kwargs.get("completions") or []),
                            [list(x) for x in ids] if isinstance(ids, list) else None))
        except Exception as exc:  # nbguard's own failure: recorded, never raised into TRL
            on_error(exc)
        return result

    setattr(reward, TAPPED, func)  # marks the wrapper, keeps the function it calls
    return reward
