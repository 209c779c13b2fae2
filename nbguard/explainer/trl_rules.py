"""Error signatures of TRL's RL trainers (GRPO, RLOO): messages raised by TRL itself, as users paste them."""
from __future__ import annotations

import re

from .match import search as match
from .rules import _diagnosis, rule

# trl/trainer/grpo_trainer.py and rloo_trainer.py (_calculate_rewards), TRL 1.x
_REWARD_COUNT = re.compile(r"the reward function '([^']+)' returned (\d+) rewards, but (\d+) were expected")


@rule("trl-reward-count-mismatch")
def reward_count_mismatch(exc):
    """TRL's "The reward function '…' returned N rewards, but M were expected": a GRPO/RLOO reward function must return one value per completion."""
    found = match(_REWARD_COUNT, str(exc))
    if not found:
        return None
    name, returned, expected = found.group(1), int(found.group(2)), int(found.group(3))
    hint = ""
    if returned == 1:
        hint = " It returned a single value: a score for the whole batch instead of a list with one per completion."
    elif returned and expected % returned == 0:
        hint = (f" {expected} is {expected // returned} x {returned}: it probably scored each prompt once, but "
                "TRL passes every completion (each prompt repeated num_generations times, in the same order).")
    detail = (
        f"GRPOTrainer/RLOOTrainer call each reward function with lists (prompts, completions, completion_ids and "
        f"every other dataset column), one entry per completion, and need back one reward per completion: "
        f"{name!r} returned {returned} for {expected}.{hint} Return a list as long as `completions` (None for a "
        "completion the function does not apply to). `nbguard.audit(trainer=trainer)` runs each reward function "
        "once on a few real completions before training (rule rl-reward-function-broken)."
    )
    return _diagnosis("trl-reward-count-mismatch", exc, f"reward function {name!r} returned {returned} rewards for "
                      f"{expected} completions", detail, reward_function=name, returned=returned, expected=expected)
