"""The watch's small parts on their own: grouping, detectors, policies' argument checks."""
import torch

from nbguard.step.tensors import summarize
from nbguard.watcher import WatchSettings, group_name
from nbguard.watcher.detectors.thresholds import EvalLossDetector, FrozenDetector, SkipStreak
from nbguard.watcher.policy.policies import drop_update


def test_group_names_are_blocks_children_or_owning_modules():
    assert group_name("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert group_name("model.layers.3.input_layernorm.weight") == "model.layers.3.input_layernorm"
    assert group_name("model.embed_tokens.weight") == "model.embed_tokens"
    assert group_name("lm_head.weight") == "lm_head"
    assert group_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.mlp"


def test_skip_streak_fires_once_per_streak_and_on_a_collapsed_scale():
    streak = SkipStreak(WatchSettings(skip_streak=3))
    assert [streak.update(True, s) for s in (8.0, 4.0)] == [None, None]
    found = streak.update(True, 2.0)
    assert found["consecutive_skipped"] == 3 and found["scale_trend"] == [8.0, 4.0, 2.0]
    assert streak.update(True, 1.0) is None  # same streak: reported once
    assert streak.update(False, 1.0) is None and streak.streak == 0
    collapsed = SkipStreak(WatchSettings(skip_streak=100, min_loss_scale=1.0))
    assert collapsed.update(True, 0.5)["scale_collapsed"] is True


def test_frozen_and_eval_detectors():
    frozen = FrozenDetector(WatchSettings(frozen_after=20))
    assert frozen.update(0, [1.0, 2.0]) is None and frozen.update(10, [1.0, 2.0]) is None
    assert frozen.update(20, [1.0, 2.0])["steps_unchanged"] == 20
    assert frozen.update(30, [1.0, 2.5]) is None  # moved again
    overflowed = FrozenDetector(WatchSettings(frozen_after=20))  # weights whose fp32 norm overflows
    assert [overflowed.update(step, [float("inf"), 2.0]) for step in (0, 10, 20, 30)] == [None] * 4
    evals = EvalLossDetector(WatchSettings())
    assert evals.update(2.5) is None and evals.update(2.4) is None
    assert evals.update(2.4)["evaluations"] == 2


def test_drop_update_sets_grads_to_none_for_optimizer_and_model():
    lin = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 3)).sum().backward()
    assert drop_update(opt, lin) == 2 and lin.weight.grad is None and lin.bias.grad is None


def test_summarize_reports_inf_over_nan_and_none_without_floats():
    t = torch.tensor([1.0, float("inf"), float("nan")])
    s = summarize([("x", t)])
    assert not s.finite and s.has_inf and s.cause == "overflow" and s.absmax == float("inf")
    assert summarize([]).absmax is None
    assert summarize([("y", torch.tensor([float("nan")]))]).cause == "invalid-op"
