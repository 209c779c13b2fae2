"""A watch is invisible once detached: every part of it (the step read, localisation's replay, verification,
activations, rewind, rows, the GradScaler binding, the stall heartbeat, the Trainer taps) is attached, runs
three steps (one of them bad where the part acts on trouble), is detached, and everything of the user's and of
torch's is exactly as before: hook dicts of every module, parameter and optimizer, torch's process-wide hooks and
the functions nbguard may wrap, the objects' own attributes, modes and grad/anomaly switches, and the threads.
"""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from watch_helpers import batches, train

import nbguard
from nbguard.testing import TinyDataset, tiny_llama
from nbguard.watcher import RewindSettings

# Functions nbguard wraps or could wrap process-wide; each must be the very object it was.
TORCH_FUNCTIONS = {
    "nn.utils.clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_,
    "nn.utils.clip_grad.clip_grad_norm_": lambda: torch.nn.utils.clip_grad.clip_grad_norm_,
    "nn.utils.clip_grad_value_": lambda: torch.nn.utils.clip_grad_value_,
    "nn.utils.get_total_norm": lambda: getattr(torch.nn.utils, "get_total_norm", None),
    "nn.utils.clip_grads_with_norm_": lambda: getattr(torch.nn.utils, "clip_grads_with_norm_", None),
    "Tensor.backward": lambda: torch.Tensor.backward,
    "autograd.backward": lambda: torch.autograd.backward,
    "optim.Optimizer.step": lambda: torch.optim.Optimizer.step,
    "optim.Optimizer.zero_grad": lambda: torch.optim.Optimizer.zero_grad,
    "nn.Module.__call__": lambda: torch.nn.Module.__call__,
}


def _global_hooks() -> dict[str, int]:
    module = torch.nn.modules.module
    optim = optimizer_module
    names = [n for n in dir(module) if n.startswith("_global_") and n.endswith("hooks")]
    out = {n: len(getattr(module, n)) for n in names}
    out.update({n: len(getattr(optim, n)) for n in dir(optim) if n.startswith("_global_optimizer")})
    return out


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def _instance_attributes(obj) -> dict[str, int]:
    """The object's own attributes, by identity: a wrapper left on it (or a new attribute) shows."""
    return {k: id(v) for k, v in vars(obj).items()}


def world(model, optimizer=None, scaler=None, trainer=None) -> dict:
    """Everything a detached watch must have left as it found it."""
    state: dict = {"global hooks": _global_hooks(),
                   "torch functions": {k: id(f()) for k, f in TORCH_FUNCTIONS.items()},
                   "switches": (torch.is_grad_enabled(), torch.is_anomaly_enabled(), torch.get_default_dtype(),
                                torch.are_deterministic_algorithms_enabled()),
                   "warning filters": len(warnings.filters)}
    for name, m in model.named_modules():
        state[f"module {name}"] = (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
                                   dict(m._backward_pre_hooks), dict(m._forward_hooks_with_kwargs),
                                   dict(m._forward_pre_hooks_with_kwargs), m.training, _instance_attributes(m))
    for name, p in model.named_parameters():
        state[f"param {name}"] = (dict(p._post_accumulate_grad_hooks or {}), dict(p._backward_hooks or {}),
                                  p.requires_grad, p.dtype)
    if optimizer is not None:
        state["optimizer"] = (dict(optimizer._optimizer_step_pre_hooks), dict(optimizer._optimizer_step_post_hooks),
                              _instance_attributes(optimizer))
    if scaler is not None:
        state["scaler"] = sorted(vars(scaler))  # its values (the scale) move with training; its attributes may not
    if trainer is not None:
        state["trainer callbacks"] = [type(c).__name__ for c in trainer.callback_handler.callbacks]
        state["trainer attributes"] = sorted(k for k in vars(trainer) if k not in ("optimizer", "lr_scheduler"))
        state["trainer methods"] = {k: id(v) for k, v in vars(trainer).items() if callable(v)
                                    and k not in ("optimizer", "lr_scheduler")}
    return state


def _threads_settle(before: set[str], timeout_s: float = 5.0) -> set[str]:
    """The threads alive now, once any thread the watch started has had time to end (a heartbeat's join)."""
    deadline = time.monotonic() + timeout_s
    while _threads() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    return _threads()


def _poison_step(model, step_batches, bad: int) -> list[dict]:
    """The batches, the ``bad``-th with a NaN embedding row hit (a NaN born in embed_tokens)."""
    token = int(step_batches[bad]["input_ids"][0, 0])
    out = []
    for i, b in enumerate(step_batches):
        b = {k: v.clone() for k, v in b.items()}
        if i != bad:
            b["input_ids"] = torch.where(b["input_ids"] == token, token + 1, b["input_ids"])
            b["labels"] = torch.where(b["labels"] == token, token + 1, b["labels"])
        out.append(b)
    with torch.no_grad():
        model.model.embed_tokens.weight[token, 0] = float("nan")
    return out


def _loop_case(**watch_kwargs):
    def run():
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step_batches = batches(3)
        before, threads = world(model, opt), _threads()
        watch = nbguard.watch(model, optimizer=opt, **watch_kwargs)
        if watch_kwargs.get("policy") in ("skip", "rewind"):
            step_batches = _poison_step(model, step_batches, bad=1)
        loader = torch.utils.data.DataLoader(TinyDataset(6, 12), batch_size=2)
        watch.track_rows(loader)
        train(model, opt, step_batches)
        watch.detach()
        if watch_kwargs.get("policy") in ("skip", "rewind"):
            with torch.no_grad():
                model.model.embed_tokens.weight.nan_to_num_(0.0)  # the planted value is the test's, not the watch's
            assert [e.kind for e in watch.events][:1] == ["nonfinite-loss"], watch.events  # it really acted
        return before, world(model, opt), threads
    return run


def _scaler_case():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before, threads = world(model, opt, scaler), _threads()
    watch = nbguard.watch(model, optimizer=opt, scaler=scaler, policy="skip")
    train(model, opt, batches(3), scaler=scaler, autocast=torch.float16)
    watch.detach()
    return before, world(model, opt, scaler), threads


def _shape(value):
    """A world with identities replaced by what they are: for comparing two twin objects, not one object."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_shape(v) for v in value)
    return "id" if isinstance(value, int) and value > 2 ** 32 else value


def _trained_trainer(tmp_path, watched: bool):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=3, per_device_train_batch_size=2,
                             logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, max_grad_norm=1.0)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(6, 12))
    before = world(model, trainer=trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if watched:
            with nbguard.watch(trainer, policy="skip", activations=True) as watch:
                trainer.train()
            assert watch.step == 3
        else:
            trainer.train()
    # the Trainer made its optimizer inside train(): it carries nothing of the watch either
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return before, world(model, opt, trainer=trainer)


def _trainer_case(tmp_path):
    """What train() itself changes (attributes it sets, the optimizer it builds) is read off an unwatched twin:
    the watched trainer, once detached, must differ from its own start exactly as the twin does."""
    threads = _threads()
    twin_before, twin_after = _trained_trainer(tmp_path / "twin", watched=False)
    before, after = _trained_trainer(tmp_path / "watched", watched=True)
    changed = {k for k in after if after[k] != before.get(k)}
    twin_changed = {k for k in twin_after if twin_after[k] != twin_before.get(k)}
    assert changed == twin_changed
    return _shape(twin_after), _shape(after), threads


CASES = {
    "read, warn": _loop_case(policy="warn"),
    "replay and verify, skip": _loop_case(policy="skip"),
    "activations and rewind": _loop_case(policy="rewind", activations=True, rewind=RewindSettings(every=1)),
    "no stall heartbeat, no run checks": _loop_case(policy="warn", config=nbguard.WatchConfig(
        stall={"after_s": None}, run_checks={"enabled": False})),
    "GradScaler binding": lambda: _scaler_case(),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_detached_watch_leaves_the_loop_and_torch_as_they_were(case):
    before, after, threads = CASES[case]()
    assert after == before
    assert _threads_settle(threads) == threads


def test_a_detached_watch_leaves_the_trainer_and_torch_as_they_were(tmp_path):
    before, after, threads = _trainer_case(tmp_path)
    assert after == before
    assert _threads_settle(threads) == threads


def test_the_snapshot_sees_what_a_watch_leaves_behind():
    """The comparison is a real check: a watch still attached differs from the world before it."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = world(model, opt)
    watch = nbguard.watch(model, optimizer=opt)
    try:
        during = world(model, opt)
        changed = {k for k in before if before[k] != during.get(k)}
        assert "optimizer" in changed and "module " in changed  # the optimizer's binding; the root's hooks
    finally:
        watch.detach()
