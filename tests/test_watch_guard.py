"""Issue 10 item 5: every watch hook goes through one guarded call; integrations use the public interface."""
import ast
import inspect

import pytest
import torch
from watch_helpers import batches, hook_counts, train

import nbguard
from nbguard.testing import tiny_llama
from nbguard.watcher.core import guard, lifecycle, record, steps, watch
from nbguard.watcher.integrations import loop, trainer

torch.set_num_threads(1)


def test_an_error_in_a_gradient_hook_is_recorded_and_training_goes_on():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = hook_counts(model, opt)
    w = nbguard.watch(model, optimizer=opt)
    w._collector.accumulations = None  # the hook that counts backwards now fails, inside backward
    with pytest.warns(RuntimeWarning, match="detached after an internal error"):
        losses = train(model, opt, batches(3))
    assert len(losses) == 3 and all(torch.isfinite(x) for x in losses)
    assert [e.kind for e in w.events] == ["watch-error"] and "TypeError" in w.events[0].message
    assert not w.attached and hook_counts(model, opt) == before


def test_an_error_in_an_activation_hook_is_recorded_and_training_goes_on():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = nbguard.watch(model, optimizer=opt, activations=True)
    w._probe._max = []  # the forward hook indexes past the end
    with pytest.warns(RuntimeWarning):
        train(model, opt, batches(2))
    assert [e.kind for e in w.events] == ["watch-error"] and not w.attached


def test_guarded_call_passes_the_stop_policy_through_and_catches_the_rest():
    seen = []
    assert guard.guarded_call(seen.append, lambda: 1 / 0) is None
    assert isinstance(seen[0], ZeroDivisionError)
    with pytest.raises(nbguard.NonFiniteError):
        guard.guarded_call(seen.append, _raise_stop)
    assert len(seen) == 1


def _raise_stop():
    raise nbguard.NonFiniteError("stop", None)


def _private_watch_attributes(module) -> list[str]:
    """``watch._x`` / ``self.watch._x`` accesses in a module's source."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "watch":
                found.append(node.attr)
    return found


def test_integrations_use_only_the_public_interface_of_the_watch():
    assert _private_watch_attributes(trainer) == []
    assert _private_watch_attributes(loop) == []
    # the interface they use exists and is documented
    for name in ("active", "stop_requested", "begin_training", "bind_trainer_step", "record_eval_loss",
                 "end_training"):
        assert (getattr(watch.NanWatch, name).__doc__ or "").strip(), name


def test_the_watch_has_no_try_blocks_of_its_own_around_hooks():
    """One guarded-call helper instead of repeated try/except blocks in the hook methods (the watch
    core's modules: its record, step state machine, lifecycle and construction)."""
    trees = [ast.parse(inspect.getsource(m)) for m in (record, steps, lifecycle, watch)]
    hooks = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and n.name in ("_root_pre", "_root_post", "_capture_micro_batch", "_pre_step", "_post_step",
                            "_before_scaler_update", "_after_scaler_update", "bind_trainer_step", "_notify")]
    assert len(hooks) == 9
    assert not [h.name for h in hooks if any(isinstance(n, ast.Try) for n in ast.walk(h))]
