"""One patch primitive (``integrations/instance_wrap.patch``) for every wrapper nbguard puts on a user's object.

For each kind of owner (an instance's method from its class, a module's function, an item of a list,
a method of an ``nn.Module`` such as DeepSpeed's engine): the user's call is unchanged (signature,
result, run once), a second patch of the same attribute joins the first wrapper instead of wrapping
it, removal in any order restores the very object that was there (or no instance attribute), and an
exception in nbguard's part is reported while the user's call still runs. Then the callers moved
onto it: torch's clip functions, TRL's reward functions, the Trainer's and the optimizer's taps.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from rl_helpers import grpo_trainer

from nbguard.introspect.trl import TAPPED
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher.integrations.instance_wrap import MARK, InstanceWrap, find_patch, patch
from nbguard.watcher.integrations.trl import RewardTap
from nbguard.watcher.reads import clip_tap


@dataclass
class Kind:
    owner: Any
    name: Any
    run: Callable[[], Any]  # calls the attribute as user code does, on fresh inputs: what it returned
    calls: Callable[[], int]  # how many times the user's own callable ran (the clip: runs; its norm tells a second clip)
    from_class: bool  # an instance that reads the attribute from its class (removal leaves no instance attribute)

    def current(self) -> Any:
        return self.owner[self.name] if isinstance(self.owner, list) else getattr(self.owner, self.name)


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    model = tiny_llama(seed=seed)
    model(**tiny_batch(seed=seed)).loss.backward()
    return model


def _optimizer_step() -> Kind:
    """An optimizer's ``step`` (its class's method, bound): the closure's loss comes back; each run adds a step."""
    model = _model_with_grads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = next(model.parameters())
    return Kind(opt, "step", lambda: opt.step(lambda: torch.tensor(2.5)),
                lambda: int(opt.state[first]["step"]) if opt.state[first] else 0, from_class=True)


def _module_function(module: Any) -> Callable[[], Kind]:
    """torch's ``clip_grad_norm_`` as the module holds it: the pre-clip norm comes back (a second clip
    of the same gradients would return ``max_norm``)."""
    def make() -> Kind:
        model = _model_with_grads()
        fresh = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        ran = []

        def run() -> Any:
            for p, g in zip(model.parameters(), fresh, strict=True):
                p.grad = g.clone()
            ran.append(1)
            return module.clip_grad_norm_(model.parameters(), 1e-3)

        return Kind(module, "clip_grad_norm_", run, lambda: len(ran), from_class=False)

    return make


def _list_item() -> Kind:
    """A reward function in TRL's list: its rewards come back as it returned them."""
    seen: list[list[str]] = []

    def scored(completions: list[str], **kwargs: Any) -> list[float]:
        """Longer completions score higher."""
        seen.append(completions)
        return [float(len(c)) for c in completions]

    funcs: list[Any] = [len, scored]
    return Kind(funcs, 1, lambda: funcs[1](completions=["a b", "c"], prompts=["p", "p"]), lambda: len(seen),
                from_class=False)


def _module_method() -> Kind:
    """A method of an ``nn.Module`` instance (DeepSpeed's engine is one: its ``backward`` and ``step``)."""
    model = tiny_llama()
    forwards: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda *_: forwards.append(1))
    batch = tiny_batch()
    return Kind(model, "forward", lambda: model(**batch).logits, lambda: len(forwards), from_class=True)


KINDS = {"instance-method": _optimizer_step, "torch.nn.utils": _module_function(torch.nn.utils),
         "torch.nn.utils.clip_grad": _module_function(torch.nn.utils.clip_grad), "list-item": _list_item,
         "module-method": _module_method}


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _snapshot(kind: Kind) -> tuple[Any, Any]:
    """The attribute as the owner holds it now, and as an instance's own attribute (None: none)."""
    own = None if isinstance(kind.owner, list) else vars(kind.owner).get(kind.name)
    return kind.current(), own


def _assert_restored(kind: Kind, before: tuple[Any, Any]) -> None:
    if kind.from_class:
        assert kind.name not in vars(kind.owner)  # the class's own method shows through again
        assert kind.current().__func__ is before[0].__func__
    else:
        assert kind.current() is before[0]


class Recorder:
    """nbguard's part of a patch, for the tests: records its runs in ``log`` (shared between patches)."""

    def __init__(self, label: str, log: list[str], fail: str | None = None):
        self.label, self.log, self.fail = label, log, fail

    def __call__(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.log.append(f"{self.label} before")
        if self.fail == "before":
            raise RuntimeError(f"{self.label} broke before the call")
        result = call(*args, **kwargs)
        self.log.append(f"{self.label} after")
        if self.fail == "after":
            raise RuntimeError(f"{self.label} broke after the call")
        return result


@pytest.fixture(params=list(KINDS))
def kind(request) -> Kind:
    return KINDS[request.param]()


def _expected(kind_name: str) -> Any:
    return KINDS[kind_name]().run()


@pytest.fixture
def expected(request, kind) -> Any:
    return _expected(request.node.callspec.params["kind"])


def test_a_patch_keeps_signature_and_result_and_runs_the_call_once(kind, expected):
    before = _snapshot(kind)
    log: list[str] = []
    held = patch(kind.owner, kind.name, Recorder("A", log))
    wrapper = kind.current()
    assert wrapper is held.wrapper and getattr(wrapper, MARK) is held.site
    assert inspect.signature(wrapper) == inspect.signature(before[0])
    assert (wrapper.__name__, wrapper.__doc__) == (before[0].__name__, before[0].__doc__)
    assert _same(kind.run(), expected) and kind.calls() == 1
    assert log == ["A before", "A after"]
    held.remove()
    _assert_restored(kind, before)


def test_patching_again_finds_the_first_wrapper_and_never_stacks(kind, expected):
    before = _snapshot(kind)
    log: list[str] = []
    first = patch(kind.owner, kind.name, Recorder("A", log))
    second = patch(kind.owner, kind.name, Recorder("B", log))
    assert second.wrapper is first.wrapper is kind.current()  # one wrapper...
    assert not hasattr(first.wrapper.__wrapped__, MARK)  # ...around the user's own callable, not around itself
    assert find_patch(kind.owner, kind.name) is first.site
    assert _same(kind.run(), expected) and kind.calls() == 1
    assert log == ["B before", "A before", "A after", "B after"]  # the newest outermost, as stacking would be
    second.remove()
    first.remove()
    _assert_restored(kind, before)


@pytest.mark.parametrize("first_out", ["A", "B"])
def test_removal_in_either_order_keeps_the_chain_and_restores_the_original(kind, expected, first_out):
    before = _snapshot(kind)
    log: list[str] = []
    patches = {"A": patch(kind.owner, kind.name, Recorder("A", log)),
               "B": patch(kind.owner, kind.name, Recorder("B", log))}
    patches[first_out].remove()
    patches[first_out].remove()  # twice: nothing more happens
    still = "B" if first_out == "A" else "A"
    assert kind.current() is patches[still].wrapper
    assert _same(kind.run(), expected) and kind.calls() == 1
    assert log == [f"{still} before", f"{still} after"]
    patches[still].remove()
    _assert_restored(kind, before)
    assert _same(kind.run(), expected) and kind.calls() == 2 and len(log) == 2  # nbguard is gone


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failure_in_nbguards_part_is_reported_and_the_call_still_runs_once(kind, expected, when):
    before = _snapshot(kind)
    reported: list[BaseException] = []
    log: list[str] = []
    held = patch(kind.owner, kind.name, Recorder("A", log, fail=when), reported.append)
    assert _same(kind.run(), expected) and kind.calls() == 1
    assert [str(e) for e in reported] == [f"A broke {when} the call"]
    held.remove()
    _assert_restored(kind, before)


def test_a_failure_with_no_handler_given_is_a_warning_and_the_call_runs():
    kind = _optimizer_step()
    held = patch(kind.owner, kind.name, Recorder("A", [], fail="before"))
    with pytest.warns(RuntimeWarning, match="A broke before the call"):
        assert _same(kind.run(), torch.tensor(2.5))
    assert kind.calls() == 1
    held.remove()


def test_the_users_own_exception_reaches_them_unchanged_and_is_not_reported():
    model = tiny_llama()
    reported: list[BaseException] = []
    held = patch(model, "forward", Recorder("A", []), reported.append)
    with pytest.raises(ValueError) as raised:
        model(input_ids=None)  # transformers' own error: neither ids nor embeddings
    assert raised.value.__traceback__ is not None and not reported
    held.remove()
    assert "forward" not in vars(model)


def test_an_instance_attribute_the_user_set_is_put_back_itself():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    theirs = functools.partial(torch.optim.AdamW.zero_grad, opt)  # the user's own, on the instance
    opt.zero_grad = theirs
    held = patch(opt, "zero_grad", Recorder("A", []))
    assert opt.zero_grad is held.wrapper
    held.remove()
    assert vars(opt)["zero_grad"] is theirs


def test_a_wrapper_set_over_ours_stays_and_ours_calls_straight_through_then_is_found_again():
    funcs: list[Any] = [lambda completions, **_: [1.0 for _ in completions]]
    original = funcs[0]
    log: list[str] = []
    ours = patch(funcs, 0, Recorder("A", log))

    @functools.wraps(funcs[0])
    def theirs(*args: Any, **kwargs: Any) -> Any:
        log.append("theirs")
        return ours.wrapper(*args, **kwargs)

    funcs[0] = theirs
    ours.remove()
    assert funcs[0] is theirs  # never taken from under someone else's wrapper
    assert funcs[0](completions=["x"]) == [1.0] and log == ["theirs"]
    again = patch(funcs, 0, Recorder("B", log))  # found under theirs: not stacked on top of it
    assert funcs[0] is theirs and again.wrapper is ours.wrapper
    funcs[0](completions=["x"])
    assert log[1:] == ["theirs", "B before", "B after"]
    again.remove()
    assert ours.inner is original


def test_a_fix_slipped_in_under_the_patch_is_called_and_kept_on_removal():
    funcs: list[Any] = [lambda completions, **_: [-math.inf for _ in completions]]
    held = patch(funcs, 0, Recorder("A", []), slot=TAPPED)

    def finite(completions: list[str], **_: Any) -> list[float]:
        return [0.0 for _ in completions]

    setattr(funcs[0], TAPPED, finite)  # what fixes/rl_fixes.py's finite-rewards does under a watch's tap
    assert funcs[0](completions=["x"]) == [0.0]
    held.remove()
    assert funcs[0] is finite


# ---- the callers moved onto it ------------------------------------------------------------------------
class _BrokenReader:
    """A clip reader whose own question fails: nbguard's part, not the user's clip."""

    def shares_clip(self, parameters: list[torch.Tensor]) -> bool:
        raise RuntimeError("the reader broke")

    def before_clip(self, parameters: list[torch.Tensor]) -> None:
        pass

    def take_from_clip(self, *args: Any) -> None:
        pass


def test_a_clip_reader_that_fails_is_reported_and_the_clip_is_torchs_own():
    model, twin = _model_with_grads(), _model_with_grads()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e-3)
    reader = _BrokenReader()
    clip_tap.tap(reader)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # a generator: the failure comes after it was listed, so torch must get the list
            norm = torch.nn.utils.clip_grad_norm_((p for p in model.parameters()), 1e-3)
    finally:
        clip_tap.untap(reader)
    assert torch.equal(norm, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    assert any("the reader broke" in str(w.message) for w in caught)
    assert not clip_tap.tapped()


def test_two_reward_taps_on_one_trainer_both_see_each_call_and_leave_the_function(tmp_path):
    from rl_helpers import length_reward

    trainer = grpo_trainer(tmp_path, reward_funcs=length_reward)
    seen: dict[str, list[Any]] = {"A": [], "B": []}
    reported: list[BaseException] = []
    taps = {k: RewardTap(trainer, seen[k].append, reported.append) for k in seen}
    assert taps["A"].wrapped == taps["B"].wrapped == 1
    assert not hasattr(getattr(trainer.reward_funcs[0], TAPPED), MARK)  # one wrapper, around the user's function
    rewards = trainer.reward_funcs[0](prompts=["p"], completions=["w3 w4 w5 w6", "w3"], completion_ids=[[3], [4]])
    assert rewards == length_reward(["w3 w4 w5 w6", "w3"])
    assert [c.values for c in seen["A"]] == [c.values for c in seen["B"]] == [rewards]
    taps["A"].remove()
    trainer.reward_funcs[0](prompts=["p"], completions=["w3"], completion_ids=[[3]])
    assert (len(seen["A"]), len(seen["B"])) == (1, 2)
    taps["B"].remove()
    assert trainer.reward_funcs[0] is length_reward and not reported


def test_the_optimizer_taps_of_two_watches_are_one_wrapper():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cleared: list[str] = []

    def note(label: str) -> Callable[..., Any]:
        def around(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            cleared.append(label)
            return call(*args, **kwargs)
        return around

    first, second = InstanceWrap(opt, "zero_grad", note("A")), InstanceWrap(opt, "zero_grad", note("B"))
    assert first.wrapper is second.wrapper is opt.zero_grad
    opt.zero_grad(set_to_none=True)
    assert cleared == ["B", "A"]
    first.remove()
    second.remove()
    assert "zero_grad" not in vars(opt)
