"""Every callable nbguard wraps on a user's object looks and behaves like the original.

accelerate's ``AcceleratedOptimizer.zero_grad`` reads ``inspect.signature(optimizer.zero_grad)`` and
raised on ``zero_grad(set_to_none=True)`` once the watch had put a ``(*args, **kwargs)`` wrapper there.
These tests walk the callables of every object the watch touches (optimizer, GradScaler, Trainer, TRL
reward functions, torch's clip functions), find each one nbguard replaced, and compare signature, name
and docstring with the original; then they run the accelerate loop that broke.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from rl_helpers import grpo_trainer, length_reward
from transformers import Trainer, TrainerCallback, TrainingArguments

import nbguard
from nbguard.testing import TinyDataset, tiny_batch, tiny_llama
from nbguard.watcher.integrations.instance_wrap import MARK


def surface(obj) -> dict[str, object]:
    """Every public callable attribute user code can reach on ``obj``, keyed by name."""
    found = {}
    for name in dir(obj):
        if name.startswith("__"):
            continue
        try:
            value = getattr(obj, name)
        except Exception:  # a property that needs state the object does not have yet
            continue
        if callable(value) and not isinstance(value, type):
            found[name] = value
    return found


def same_callable(a, b) -> bool:
    """A bound method is made anew at each attribute access: compare what it binds."""
    if inspect.ismethod(a) and inspect.ismethod(b):
        return a.__func__ is b.__func__ and a.__self__ is b.__self__
    return a is b


def replaced(before: dict, after: dict) -> dict[str, tuple[object, object]]:
    return {n: (before[n], after[n]) for n in before.keys() & after.keys() if not same_callable(before[n], after[n])}


def assert_invisible(original, wrapper) -> None:
    assert getattr(wrapper, MARK, False) or hasattr(wrapper, "__wrapped__"), f"{wrapper!r} is not nbguard's"
    assert inspect.signature(wrapper) == inspect.signature(original)
    assert wrapper.__name__ == original.__name__
    assert wrapper.__doc__ == original.__doc__
    assert getattr(wrapper, "__module__", None) == getattr(original, "__module__", None)


def test_loop_optimizer_and_scaler_wrappers_keep_signature_name_and_doc():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    before = {"opt": surface(opt), "scaler": surface(scaler)}
    watch = nbguard.watch(model, optimizer=opt, scaler=scaler)
    try:
        changed = {"opt": replaced(before["opt"], surface(opt)), "scaler": replaced(before["scaler"], surface(scaler))}
        assert set(changed["opt"]) == {"zero_grad"} and set(changed["scaler"]) == {"update"}
        for pairs in changed.values():
            for original, wrapper in pairs.values():
                assert_invisible(original, wrapper)
        assert "set_to_none" in inspect.signature(opt.zero_grad).parameters  # what accelerate reads
        # every argument the original takes reaches it: set_to_none=False keeps zero tensors, True drops them
        model(**tiny_batch(2, 8)).loss.backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        with pytest.raises(TypeError):  # the original's own error for an argument it does not take
            opt.zero_grad(no_such_argument=True)
    finally:
        watch.detach()
    # detached: the very objects user code had before
    assert replaced(before["opt"], surface(opt)) == {} and replaced(before["scaler"], surface(scaler)) == {}


def test_torch_clip_functions_keep_signature_name_and_doc():
    import torch.nn.utils.clip_grad as clip_grad

    modules = (torch.nn.utils, clip_grad)
    before = [surface(m) for m in modules]
    model = tiny_llama()
    watch = nbguard.watch(model, optimizer=torch.optim.AdamW(model.parameters()))
    try:
        changed = {}
        for m, b in zip(modules, before):
            changed.update({f"{m.__name__}.{n}": pair for n, pair in replaced(b, surface(m)).items()})
        assert "torch.nn.utils.clip_grad_norm_" in changed  # the tap is on: this walk sees it
        for original, wrapper in changed.values():
            assert_invisible(original, wrapper)
    finally:
        watch.detach()


def test_trainer_wrappers_keep_signature_name_and_doc(tmp_path):
    """The Trainer's methods and the optimizer it builds inside train(), walked while it trains."""
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1)
    walked: dict[str, dict] = {}

    class Walk(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            if state.global_step == 1:
                walked["trainer"] = replaced(before, surface(trainer))
                inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
                walked["optimizer"] = replaced(surface(type(inner)), surface(inner))  # the class's own methods

    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(8), callbacks=[Walk()])
    before = surface(trainer)
    watch = nbguard.watch(trainer)
    trainer.train()
    watch.detach()
    assert "compute_loss" in walked["trainer"], sorted(walked["trainer"])  # (training_step: TRL trainers only)
    assert set(walked["optimizer"]) >= {"zero_grad"}
    for original, wrapper in walked["trainer"].values():
        assert_invisible(original, wrapper)
    for name, (unbound, wrapper) in walked["optimizer"].items():
        # the class attribute is the unbound function: compare without ``self``
        params = list(inspect.signature(unbound).parameters.values())[1:]
        assert list(inspect.signature(wrapper).parameters.values()) == params, name
        assert wrapper.__name__ == unbound.__name__ and wrapper.__doc__ == unbound.__doc__
    assert replaced(before, surface(trainer)) == {}


def test_trl_reward_function_wrappers_keep_signature_name_and_doc(tmp_path):
    trainer = grpo_trainer(tmp_path, reward_funcs=[length_reward], max_steps=1)
    watch = nbguard.watch(trainer)
    try:
        (wrapper,) = trainer.reward_funcs
        assert wrapper is not length_reward  # the tap is on
        assert_invisible(length_reward, wrapper)
    finally:
        watch.detach()
    assert trainer.reward_funcs == [length_reward]


def _accelerate_loop(watched: bool, steps: int = 3):
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    watch = nbguard.watch(model, optimizer=opt) if watched else None
    try:
        for step in range(steps):
            loss = model(**tiny_batch(2, 8, seed=step)).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)  # the line that raised under the watch (accelerate 1.15)
    finally:
        if watch is not None:
            watch.detach()
    return accelerator.unwrap_model(model), watch


def test_accelerate_loop_with_set_to_none_trains_as_without_the_watch():
    plain, _ = _accelerate_loop(watched=False)
    watched, watch = _accelerate_loop(watched=True)
    assert watch.step == 3 and watch.events == []
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        assert b.grad is None  # set_to_none=True reached torch's zero_grad
