"""An interrupted step (KeyboardInterrupt in a notebook cell) never taints the next clean step."""
from __future__ import annotations

import pytest
import torch
from watch_helpers import batches, snapshot

import nbguard
from nbguard.testing import tiny_llama


class InterruptOnce:
    """A forward hook on a layer: its output turns NaN (the step's loss is NaN) and, optionally,
    the forward is interrupted there, as a user's Ctrl-C would."""

    def __init__(self, module: torch.nn.Module, raise_inside: bool):
        self.raise_inside = raise_inside
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.handle.remove()
        if self.raise_inside:
            raise KeyboardInterrupt
        return output * float("nan")


def moved(before: dict, model: torch.nn.Module) -> bool:
    after = snapshot(model)
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("policy", ["warn", "skip", "stop"])
@pytest.mark.parametrize("where", ["inside-forward", "after-forward", "after-backward"])
def test_plain_loop_step_after_an_interrupt_is_judged_on_its_own(policy, where):
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, verify=False)
    data = batches(4)
    # the interrupted step: its loss is NaN (or its forward never returns)
    InterruptOnce(model.model.layers[0].mlp, raise_inside=where == "inside-forward")
    with pytest.raises(KeyboardInterrupt):
        opt.zero_grad()
        loss = model(**data[0]).loss
        assert torch.isnan(loss)
        if where == "after-backward":
            loss.backward()
        raise KeyboardInterrupt
    # the user fixes nothing and runs the loop again: every step is clean
    before = snapshot(model)
    for batch in data:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    watch.detach()
    assert watch.events == [], watch.summary()
    assert watch.step == len(data) and watch.history.skipped_steps == []
    assert moved(before, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_interrupt_during_replay_leaves_the_watch_capturing():
    """A KeyboardInterrupt inside the localising replay: the watch is not left paused."""
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, policy="skip", verify=False)
    data = batches(3)
    InterruptOnce(model.model.layers[0].mlp, raise_inside=False)  # the real step: NaN loss
    opt.zero_grad()
    model(**data[0]).loss.backward()
    interrupt = model.model.layers[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        opt.step()  # the check replays the step eagerly: the replay is interrupted
    interrupt.remove()
    before = snapshot(model)
    for batch in data[1:]:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    watch.detach()
    assert not any(e.step >= 1 for e in watch.events), watch.summary()
    assert len(watch.micro_batches) == 0 and moved(before, model)


@pytest.mark.parametrize("policy", ["warn", "skip", "stop"])
def test_trainer_train_again_after_an_interrupted_step(policy):
    """A NaN step interrupted after its forward; ``train()`` again on clean data runs every step."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from nbguard.testing import TinyDataset

    torch.manual_seed(0)
    model = tiny_llama()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16))
    watch = nbguard.watch(trainer, policy=policy, verify=False)
    InterruptOnce(model.model.layers[0].mlp, raise_inside=False)  # this forward's loss is NaN
    interrupt = model.register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    interrupt.remove()
    before = snapshot(model)
    trainer.train()
    watch.detach()
    assert watch.events == [], watch.summary()
    assert trainer.state.global_step == 2 and watch.step == 2
    assert moved(before, model)
