"""Issue 12 section 4: the watch and the replay accept any output a training loop uses.

Each case wraps a tiny Llama whose layer-1 MLP activation makes NaN in backward (its forward stays
finite) and returns the model's result in one shape; the loop takes the loss from that shape, or
computes it outside the model from the logits. The watch must see the step, read the loss where
the model returned one, and the replay must name the poisoned activation in backward.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from watch_helpers import PoisonedSiLU, batches

import nbguard
from nbguard.testing import tiny_llama

torch.set_num_threads(1)


@dataclasses.dataclass
class DataclassOut:
    logits: torch.Tensor
    loss: torch.Tensor


class NamedOut(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


class LossCarrier:
    """A plain object with a ``.loss``, as some custom heads return."""

    def __init__(self, loss, logits):
        self.loss = loss
        self.logits = logits


def outside_loss(logits, labels):
    """Causal LM loss computed by the loop, not by the model."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


# shape -> (what the model returns from an HF output, how the loop gets its loss, whether the model gave a loss)
SHAPES = {
    "scalar tensor": (lambda o: o.loss, lambda out, b: out, True),
    "tuple": (lambda o: (o.loss, o.logits), lambda out, b: out[0], True),
    "list": (lambda o: [o.loss, o.logits], lambda out, b: out[0], True),
    "dict": (lambda o: {"loss": o.loss, "logits": o.logits}, lambda out, b: out["loss"], True),
    "ModelOutput": (lambda o: o, lambda out, b: out.loss, True),
    "dataclass": (lambda o: DataclassOut(o.logits, o.loss), lambda out, b: out.loss, True),
    "named tuple": (lambda o: NamedOut(o.logits, o.loss), lambda out, b: out.loss, True),
    "object with .loss": (lambda o: LossCarrier(o.loss, o.logits), lambda out, b: out.loss, True),
    "logits tensor, loss outside": (lambda o: o.logits, lambda out, b: outside_loss(out, b["labels"]), False),
    "dict of logits, loss outside": (lambda o: {"logits": o.logits},
                                     lambda out, b: outside_loss(out["logits"], b["labels"]), False),
}


class Shaped(torch.nn.Module):
    def __init__(self, shape: str, armed: bool):
        super().__init__()
        self.model = tiny_llama()
        self.model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed)
        self.shape, self.gives_loss = SHAPES[shape][0], SHAPES[shape][2]

    def forward(self, input_ids, attention_mask, labels):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         labels=labels if self.gives_loss else None)
        return self.shape(out)


def _run(shape: str, armed: bool, steps: int = 2):
    model = Shaped(shape, armed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    take_loss = SHAPES[shape][1]
    with nbguard.watch(model, optimizer=opt) as watch:
        for batch in batches(steps):
            loss = take_loss(model(**batch), batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return watch


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_backward_fault_is_localised_whatever_the_output_shape(shape):
    watch = _run(shape, armed=True)
    assert [e.kind for e in watch.events] == ["nonfinite-grad"], watch.summary()
    event = watch.events[0]
    assert event.step == 0 and event.cause == "invalid-op"
    assert event.origin("forward") is None
    assert event.origin("backward").module == "model.model.layers.1.mlp.act_fn", event.message
    first_loss = watch.history.to_dict()["loss"][0]
    # the model's own loss, or the one computed after it (read where backward() started)
    assert isinstance(first_loss, float) and 3.0 < first_loss < 6.0


@pytest.mark.parametrize("shape", ["named tuple", "logits tensor, loss outside"])
def test_the_same_shapes_train_quietly_when_nothing_is_wrong(shape):
    watch = _run(shape, armed=False, steps=3)
    assert watch.events == [] and watch.step == 3
    assert all(v is not None and v > 0 for v in watch.history.total_grad_norm)
