"""What a training micro-batch needs to be replayed: its inputs, RNG state, autocast state and
the gradient that arrived at the model's outputs during the real backward.

Only references are kept (no copies); they are released at the end of every optimizer step.
"""
from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from .precision import AutocastRegions
from .tensors import iter_tensors


def capture_rng(host: bool = False) -> dict[str, Any]:
    """The RNG state dropout will draw from: torch's, and CUDA's once CUDA is initialised (host copies; no
    device sync). ``host``: Python's ``random`` and NumPy's global generator (when NumPy is imported) as well,
    every global RNG a sampler, a collator or a user's code may draw from.

    Each micro-batch captures without ``host``: its replay needs what dropout draws, and the two host
    generators' states cost ~30 us (``random.getstate``) and ~100 us (``numpy.random.get_state``) to copy,
    against ~5 us for torch's.
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    # is_initialized() first: a flag read, where is_available() asks the driver (~10 us a micro-batch on CPU)
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if host:
        state["random"] = random.getstate()
        numpy = sys.modules.get("numpy")  # (not imported: nothing has drawn from it, and nothing here will)
        if numpy is not None:
            state["numpy"] = numpy.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Every generator ``state`` holds put back as captured."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "random" in state:
        random.setstate(state["random"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Every global RNG (torch, CUDA, ``random``, NumPy) put back after the block: the user's data order and
    dropout must not change because nbguard ran something."""
    state = capture_rng(host=True)
    try:
        yield
    finally:
        restore_rng(state)


def _is_loss(value: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1


def find_loss(output: Any) -> tuple[str, torch.Tensor] | None:
    """The loss a model returned, with its path in :func:`iter_tensors`' spelling.

    ``output.loss`` / ``output["loss"]`` (ModelOutput, dicts, dataclasses, any object with a
    ``.loss``); a bare scalar tensor; the scalar element of a tuple or list, wherever it sits
    (transformers' ``return_dict=False`` puts the loss first, nanoGPT returns ``(logits, loss)``);
    where a tuple holds several scalars, the first a backward can start from. None: the loss is
    computed outside the model, from its outputs.
    """
    if isinstance(output, torch.Tensor):
        return ("output", output) if output.dim() == 0 and output.is_floating_point() else None
    if isinstance(output, dict):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)):
        if hasattr(output, "_fields") and "loss" in output._fields:  # a named tuple with a loss field
            i = output._fields.index("loss")
            return (f"[{i}]", output[i]) if _is_loss(output[i]) else None
        scalars = [(i, v) for i, v in enumerate(output) if _is_loss(v) and v.dim() == 0]
        chosen = next((s for s in scalars if s[1].requires_grad), scalars[0] if scalars else None)
        return (f"[{chosen[0]}]", chosen[1]) if chosen is not None else None
    else:
        loss = getattr(output, "loss", None)
    return ("loss", loss) if _is_loss(loss) else None


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss tensor a model returned, or None (see :func:`find_loss`)."""
    found = find_loss(output)
    return found[1] if found is not None else None


def backward_targets(output: Any, found: tuple[str, torch.Tensor] | None) -> list[tuple[str, torch.Tensor]]:
    """The output tensors the real backward starts from (``found``: ``find_loss(output)``).

    When the model computed its own loss, only the loss: hooking logits as well would count the
    loss's contribution twice in the replay. Otherwise every floating output that needs a grad
    (the loss is then computed outside the model from them).
    """
    if found is not None and found[1].requires_grad:
        return [found]
    return [(p, t) for p, t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]


IGNORE_INDEX = -100


def supervised_mask(labels: torch.Tensor) -> torch.Tensor:
    """(rows, tokens): the labels the causal loss scores, as the Trainer counts ``num_items_in_batch``.

    The loss pads each row's labels and shifts them by one, so a row's first label is never scored and a
    row of one token scores nothing (TRL's EOS alone, where the tokenizer encoded the text to nothing).
    A 1-D tensor is one sequence without a batch dimension (a single label, one label per row, is kept).
    """
    if labels.dim() >= 2:
        scored = labels[..., 1:]
    else:
        flat = labels.reshape(-1)
        scored = (flat[1:] if flat.numel() > 1 else flat)[None]
    return (scored != IGNORE_INDEX).flatten(1)  # (flatten, not reshape(rows, -1): a (rows, 0) shift has no -1)


def supervised_rows(labels: torch.Tensor) -> torch.Tensor:
    """Per row: does it keep a label other than -100 after the causal shift?"""
    return supervised_mask(labels).any(dim=1)


@dataclass
class MicroBatch:
    index: int
    args: tuple
    kwargs: dict
    rng: dict[str, Any]
    autocast: AutocastRegions
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    trainer_labels: torch.Tensor | None = None  # the Trainer's labels when it kept them from the model

    def record_output_grads(self, output: Any, found: tuple[str, torch.Tensor] | None,
                            also: Callable[[torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Hook the outputs so the real backward leaves us the gradient that reached them (``found``:
        ``find_loss(output)``). ``also``: a tensor hook of the caller's that the same hook calls (one
        hook per tensor, not two). Returns the hooked tensors."""
        targets = backward_targets(output, found)
        for path, tensor in targets:
            tensor.register_hook(self._keeper(path, also))
        return [tensor for _, tensor in targets]

    def _keeper(self, path: str, also: Callable[[torch.Tensor], None] | None):
        def keep(grad: torch.Tensor) -> None:
            self.output_grads[path] = grad.detach()
            if also is not None:
                also(grad)
        return keep

    def labels(self) -> torch.Tensor | None:
        labels = self.kwargs.get("labels")
        return labels if isinstance(labels, torch.Tensor) else self.trainer_labels

    def has_no_supervised_tokens(self) -> bool:
        """All labels -100 (after the causal shift): the mean loss is 0/0."""
        labels = self.labels()
        return labels is not None and not bool(supervised_mask(labels).any())
