"""The per-step history: gradient norms (and, opt-in, activation abs-max) per module group in bounded ring buffers."""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from typing import Any

from ...findings import encode_float


def group_name(param_name: str) -> str:
    """The module group a parameter belongs to, for heatmap rows.

    Inside a numbered container the group is the block's direct child
    (``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn``); elsewhere the
    module that owns the parameter (``model.embed_tokens.weight`` -> ``model.embed_tokens``).
    """
    # the last numbered container wins: LoRA names nest ``layers.N`` inside ``base_model.model``
    candidates = list(re.finditer(r"\.\d+\.", param_name))
    if candidates:
        last = candidates[-1]
        rest = param_name[last.end():].split(".")
        if len(rest) > 1:
            return param_name[: last.end()] + rest[0]
        return param_name[: last.end() - 1]
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


class GradHistory:
    """Groups x steps gradient norms plus per-step loss, total norm and loss scale (bounded)."""

    def __init__(self, groups: list[str], capacity: int = 2048):
        self.groups = list(groups)
        self.capacity = capacity
        self._steps: deque[int] = deque(maxlen=capacity)
        self._norms: deque[list[float | None]] = deque(maxlen=capacity)
        self._loss: deque[float | None] = deque(maxlen=capacity)
        self._total: deque[float | None] = deque(maxlen=capacity)
        self._scale: deque[float | None] = deque(maxlen=capacity)
        self._skipped: deque[bool] = deque(maxlen=capacity)
        self.rewinds: list[dict[str, Any]] = []  # policy rewind: one entry per rewind (step, restored_after_step, ...)
        # per-group ||Δw|| / ||w|| of each step's update (update_norms.py): a step's arrive with the next read
        self._update: deque[list[float | None] | None] = deque(maxlen=capacity)
        self._total_update: deque[float | None] = deque(maxlen=capacity)
        self.update_norm_unavailable: str | None = None  # why there are none (said once)
        # where they are estimates (a CPU above update_norms.SAMPLE_ABOVE): {"parts": k, "from_step": s}, each
        # step from s on reading 1/k of each weight's rows
        self.update_norm_sampled: dict[str, int] | None = None

    def add_groups(self, groups: list[str]) -> None:
        """Groups that appeared after attach (a module swapped in): earlier steps have no value for them."""
        self.groups.extend(groups)
        for row in self._norms:
            row.extend([None] * len(groups))
        for update in self._update:
            if update is not None:
                update.extend([None] * len(groups))

    def append(self, step: int, norms: Sequence[float | None], loss: float | None, total: float | None,
               scale: float | None, skipped: bool) -> None:
        self._steps.append(step)
        self._norms.append(list(norms))
        self._loss.append(loss)
        self._total.append(total)
        self._scale.append(scale)
        self._skipped.append(bool(skipped))
        self._update.append(None)
        self._total_update.append(None)

    def record_update(self, step: int, ratios: Sequence[float | None], total: float | None) -> bool:
        """The update norms of ``step`` (per group ||Δw|| / ||w||, and over every group), which arrive
        after the step was appended; False where the step is no longer (or not yet) in the history."""
        for back in range(1, min(len(self._steps), 4) + 1):  # the last step, or one of the few before it
            if self._steps[-back] == step:
                row = list(ratios) + [None] * (len(self.groups) - len(ratios))
                self._update[-back] = row
                self._total_update[-back] = total
                return True
        return False

    def record_update_sampling(self, parts: int, step: int) -> None:
        """The update norms from ``step`` on read 1/``parts`` of each weight's rows: estimates (the first
        sampled step is kept where the weights change and are sampled again)."""
        first = self.update_norm_sampled["from_step"] if self.update_norm_sampled else step
        self.update_norm_sampled = {"parts": parts, "from_step": first}

    def record_rewind(self, entry: dict[str, Any]) -> None:
        """A rewind at ``entry["step"]`` back to the state after ``entry["restored_after_step"]``."""
        self.rewinds.append(dict(entry))

    @property
    def steps(self) -> list[int]:
        return list(self._steps)

    @property
    def skipped_steps(self) -> list[int]:
        return [s for s, k in zip(self._steps, self._skipped) if k]

    @property
    def total_grad_norm(self) -> list[float | None]:
        return list(self._total)

    @property
    def loss(self) -> list[float | None]:
        return list(self._loss)

    @property
    def loss_scale(self) -> list[float | None]:
        return list(self._scale)

    def grad_norm(self, group: str) -> list[float | None]:
        i = self.groups.index(group)
        return [row[i] for row in self._norms]

    def update_norm(self, group: str) -> list[float | None]:
        """``group``'s ||Δw|| / ||w|| per step (None: not read for that step)."""
        i = self.groups.index(group)
        return [row[i] if row is not None else None for row in self._update]

    @property
    def total_update_norm(self) -> list[float | None]:
        """||Δw|| / ||w|| over every trainable weight, per step (None: not read for that step)."""
        return list(self._total_update)

    def __len__(self) -> int:
        return len(self._steps)

    def _update_section(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if any(v is not None for v in self._total_update):
            out["update_norm"] = [[encode_float(row[i]) if row is not None else None for row in self._update]
                                  for i in range(len(self.groups))]
            out["total_update_norm"] = [encode_float(v) for v in self._total_update]
            if self.update_norm_sampled is not None:
                out["update_norm_sampled"] = dict(self.update_norm_sampled)
        if self.update_norm_unavailable is not None:
            out["update_norm_unavailable"] = self.update_norm_unavailable
        return out

    def to_dict(self) -> dict[str, Any]:
        """The "history" section of the payload document (groups x steps)."""
        rows = [[encode_float(row[i]) for row in self._norms] for i in range(len(self.groups))]
        rewinds = {"rewinds": [dict(r) for r in self.rewinds]} if self.rewinds else {}
        return {**rewinds,
            "groups": list(self.groups),
            "steps": self.steps,
            "grad_norm": rows,
            "skipped_steps": self.skipped_steps,
            "loss": [encode_float(v) for v in self._loss],
            "total_grad_norm": [encode_float(v) for v in self._total],
            "loss_scale": [encode_float(v) for v in self._scale],
            **self._update_section(),
        }


class ActivationHistory:
    """Groups x steps output abs-max (bounded like :class:`GradHistory`), against a dtype limit."""

    def __init__(self, groups: list[str], capacity: int = 2048, limit: float = 65504.0):
        self.groups = list(groups)
        self.capacity = capacity
        self.limit = float(limit)
        self._steps: deque[int] = deque(maxlen=capacity)
        self._absmax: deque[list[float | None]] = deque(maxlen=capacity)

    def append(self, step: int, absmax: list[float | None]) -> None:
        self._steps.append(step)
        self._absmax.append(list(absmax))

    @property
    def steps(self) -> list[int]:
        return list(self._steps)

    def absmax(self, group: str) -> list[float | None]:
        i = self.groups.index(group)
        return [row[i] for row in self._absmax]

    def __len__(self) -> int:
        return len(self._steps)

    def to_dict(self) -> dict[str, Any]:
        """The "activations" section of the payload document (groups x steps)."""
        return {
            "groups": list(self.groups),
            "steps": self.steps,
            "absmax": [[encode_float(row[i]) for row in self._absmax] for i in range(len(self.groups))],
            "limit": self.limit,
        }
