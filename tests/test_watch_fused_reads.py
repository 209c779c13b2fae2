"""Issue 19 item 5: one fused gradient read per step (no hook per parameter) keeps what the
per-parameter hooks gave: pre-clip, unscaled, per group, accumulated over micro-batches."""
import math
import tempfile

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from watch_helpers import PoisonedSiLU, batches

from nbguard.testing import TinyDataset, tiny_llama
from nbguard.watcher import NanWatch
from nbguard.watcher.reads import clip_tap

torch.set_num_threads(1)


class _ArmAt(TrainerCallback):
    def __init__(self, module, step):
        self.module, self.step = module, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.module.armed = state.global_step == self.step


def _parameter_hooks(model) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _watch(target, per_parameter: bool, **kwargs) -> NanWatch:
    watch = NanWatch(target, **kwargs)
    watch._collector.per_parameter = per_parameter  # the multi-rank path, as the reference
    return watch.attach()


def _trainer_norms(per_parameter: bool):
    model = tiny_llama()
    act = model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(32), callbacks=[_ArmAt(act, 2)])
    watch = _watch(trainer, per_parameter, policy="skip")
    hooks = _parameter_hooks(model)
    trainer.train()
    watch.detach()
    return watch, hooks


def _same(a, b) -> bool:
    """Two histories hold the same per-group norms at every step (NaN where the other has NaN)."""
    assert a.groups == b.groups and len(a) == len(b)
    return all(math.isclose(x, y, rel_tol=1e-5) or (math.isnan(x) and math.isnan(y))
               for g in a.groups for x, y in zip(a.grad_norm(g), b.grad_norm(g), strict=True))


def test_trainer_clipping_a_nan_names_its_group_with_no_hook_per_parameter():
    fused, fused_hooks = _trainer_norms(per_parameter=False)
    reference, reference_hooks = _trainer_norms(per_parameter=True)
    assert fused_hooks == 0 and reference_hooks == sum(1 for _ in tiny_llama().parameters())
    norms = {g: fused.history.grad_norm(g) for g in fused.history.groups}
    # the NaN step (2): the poisoned MLP and what lies before it are NaN, the head is not, although
    # the Trainer clipped every gradient with a NaN factor before the optimizer step
    assert math.isnan(norms["model.layers.1.mlp"][2]) and math.isnan(norms["model.embed_tokens"][2])
    assert math.isfinite(norms["lm_head"][2]) and math.isfinite(norms["model.norm"][2])
    assert [e.kind for e in fused.events] == ["nonfinite-grad"]
    assert "lm_head" not in fused.events[0].evidence["nonfinite_groups"]
    # the same per-group norms the per-parameter hooks give, on every step (accumulated over 2 micro-batches)
    assert _same(fused.history, reference.history)
    assert not any(math.isnan(row[step]) for row in norms.values() for step in (0, 1, 3))


def _loop_norms(per_parameter: bool, scaled: bool, unscale_and_clip: bool):
    """Two steps of 2 micro-batches each, with a GradScaler or without, clipping or not."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    watch = _watch(model, per_parameter, optimizer=opt, scaler=scaler)
    for i, batch in enumerate(batches(4)):
        loss = model(**batch).loss / 2
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if i % 2 == 1:
            if unscale_and_clip:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()  # nothing clipped: the fused read happens at the optimizer's pre-step hook
            opt.zero_grad()
    watch.detach()
    return watch


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("unscale_and_clip", [True, False])
def test_plain_loop_norms_are_unscaled_pre_clip_and_accumulated_as_the_hooks_give(scaled, unscale_and_clip):
    fused = _loop_norms(per_parameter=False, scaled=scaled, unscale_and_clip=unscale_and_clip)
    reference = _loop_norms(per_parameter=True, scaled=scaled, unscale_and_clip=unscale_and_clip)
    assert fused.step == 2 and fused.history.loss_scale == ([1024.0, 1024.0] if scaled else [None, None])
    assert _same(fused.history, reference.history)
    # unscaled and before the clip to 0.01: the size of a tiny model's gradient, not 1024 times it
    assert all(0.01 < fused.history.total_grad_norm[s] < 50 for s in (0, 1))


def test_two_watches_share_one_clip_wrapper_and_detach_restores_torch():
    original = torch.nn.utils.clip_grad_norm_
    models = [tiny_llama(), tiny_llama(seed=1)]
    watches = [_watch(m, False, optimizer=torch.optim.SGD(m.parameters(), lr=1e-3)) for m in models]
    assert clip_tap.tapped() and torch.nn.utils.clip_grad_norm_.__wrapped__ is original
    watches[0].detach()
    assert clip_tap.tapped()  # the other watch still reads before clipping
    watches[1].detach()
    assert not clip_tap.tapped() and torch.nn.utils.clip_grad_norm_ is original
    assert all(_parameter_hooks(m) == 0 for m in models)


def test_the_weight_fingerprint_follows_a_model_cast_after_attach():
    """``model.to(bf16)`` keeps the Parameter objects the watch covers and changes their dtype: the
    fingerprint then reads bf16 norms, and a run whose weights do not move is still named frozen."""
    from nbguard.watcher.detectors.thresholds import WatchSettings

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights never move
    watch = NanWatch(model, optimizer=opt, settings=WatchSettings(frozen_check_every=1, frozen_after=3)).attach()
    model.to(torch.bfloat16)
    for batch in batches(5):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    watch.detach()
    assert [e.kind for e in watch.events] == ["frozen-params"], watch.summary()
    assert watch.events[0].evidence["steps_unchanged"] == 3


def test_a_collected_watch_reads_no_more_clips_and_the_live_one_still_does():
    """The clip keeps its readers weakly: a watch dropped without detach (and its model) is freed and
    leaves the readers; a watch still attached keeps reading its norms at the clip."""
    import gc
    import weakref

    dropped_model, kept_model = tiny_llama(), tiny_llama(seed=1)
    dropped = _watch(dropped_model, False, optimizer=torch.optim.SGD(dropped_model.parameters(), lr=1e-3))
    kept_opt = torch.optim.SGD(kept_model.parameters(), lr=1e-3)
    kept = _watch(kept_model, False, optimizer=kept_opt)
    assert len(clip_tap._READERS) == 2
    collector = weakref.ref(dropped._collector)
    del dropped, dropped_model
    gc.collect()
    assert collector() is None and len(clip_tap._READERS) == 1
    kept_model(**batches(1)[0]).loss.backward()
    total = torch.nn.utils.clip_grad_norm_(kept_model.parameters(), 1.0)
    kept_opt.step()
    assert kept.step == 1 and kept.history.total_grad_norm[0] == pytest.approx(float(total), rel=1e-6)
    kept.detach()
    assert not clip_tap.tapped()
