"""Real HF Trainer and TRL SFTTrainer runs with planted faults (tiny models, CPU, no downloads)."""
import tempfile

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from watch_helpers import PoisonedSiLU, hook_counts

import nbguard
from nbguard.testing import TinyDataset, tiny_llama
from nbguard.watcher import NanWatch, WatchSettings

torch.set_num_threads(1)


def _args(**overrides):
    base = dict(output_dir=tempfile.mkdtemp(), max_steps=5, per_device_train_batch_size=2, use_cpu=True,
                report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    base.update(overrides)
    return TrainingArguments(**base)


class _ArmAt(TrainerCallback):
    def __init__(self, module, step):
        self.module, self.step = module, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.module.armed = state.global_step == self.step


def test_trainer_backward_nan_is_localised_before_clipping_and_skipped():
    model = tiny_llama()
    act = model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)
    trainer = Trainer(model=model, args=_args(gradient_accumulation_steps=2, max_grad_norm=1.0),
                      train_dataset=TinyDataset(32), callbacks=[_ArmAt(act, 2)])
    assert trainer.optimizer is None  # created lazily inside train(): the watch binds it then
    watch = nbguard.watch(trainer, policy="skip")
    trainer.train()
    assert trainer.state.global_step == 5 and watch.step == 5
    [event] = watch.events
    assert event.kind == "nonfinite-grad" and event.step == 2 and event.cause == "invalid-op"
    origin = event.origin("backward")
    assert origin.module == "model.layers.1.mlp.act_fn" and origin.micro_batch == 0
    # Trainer clipped with a NaN factor, but the watch's norms were taken before clipping
    assert "lm_head" not in event.evidence["nonfinite_groups"] and "model.norm" not in event.evidence["nonfinite_groups"]
    assert event.evidence["micro_batches"] == 2
    assert watch.history.skipped_steps == [2]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(v is not None and 1.0 < v < 100 for v in watch.history.loss)  # a real loss, not a share
    watch.detach()


class _PoisonRowAt(TrainerCallback):
    """Makes embedding row 5 NaN when ``step`` begins, and keeps the weights seen then."""

    def __init__(self, model, step):
        self.model, self.step, self.weights = model, step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                self.model.model.embed_tokens.weight[5] = float("nan")
            self.weights = self.model.model.layers[0].mlp.up_proj.weight.detach().clone()


def test_trainer_stop_policy_ends_training_cleanly():
    model = tiny_llama()
    data = TinyDataset(32)
    for row in data.rows:  # every batch holds token 5
        row["input_ids"][4] = 5
    poison = _PoisonRowAt(model, 2)
    trainer = Trainer(model=model, args=_args(), train_dataset=data, callbacks=[poison])
    watch = nbguard.watch(trainer, policy="stop")
    trainer.train()  # no exception: control.should_training_stop
    assert trainer.state.global_step == 3 and watch.step == 3
    [event] = watch.events
    assert event.step == 2 and event.cause == "nonfinite-parameter"
    assert event.origin("forward").module == "model.embed_tokens"
    assert torch.equal(poison.weights, model.model.layers[0].mlp.up_proj.weight)  # last good weights kept
    watch.detach()


def test_trainer_frozen_eval_loss_and_frozen_params():
    model = tiny_llama()
    trainer = Trainer(model=model, args=_args(learning_rate=0.0, weight_decay=0.0, eval_strategy="steps", eval_steps=2,
                                              max_steps=6),
                      train_dataset=TinyDataset(32), eval_dataset=TinyDataset(8, seed=1))
    watch = NanWatch(trainer, settings=WatchSettings(frozen_check_every=1, frozen_after=3)).attach()
    trainer.train()
    kinds = [e.kind for e in watch.events]
    assert "frozen-eval-loss" in kinds and "frozen-params" in kinds
    frozen = next(e for e in watch.events if e.kind == "frozen-eval-loss")
    assert frozen.evidence["evaluations"] == 2
    watch.detach()


def test_trainer_detach_removes_callback_and_hooks():
    model = tiny_llama()
    trainer = Trainer(model=model, args=_args(max_steps=2), train_dataset=TinyDataset(8))
    callbacks = list(trainer.callback_handler.callbacks)
    before = hook_counts(model)
    watch = nbguard.watch(trainer)
    nbguard.watch(trainer)  # a second watch replaces the first instead of stacking
    assert not watch.attached
    trainer.train()
    second = [w for w in nbguard.session.SESSION.watches if w.target is trainer][-1]
    assert second.attached and second.step == 2
    opt = second.optimizer
    opt_before = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
    second.detach()
    assert hook_counts(model) == before
    assert list(trainer.callback_handler.callbacks) == callbacks
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (opt_before[0] - 1, opt_before[1] - 1)


def test_trainer_with_a_grad_scaler_skipping_every_step_the_seed_case():
    """fp16 Trainer runs on a GPU get accelerate's GradScaler; on CPU we hand the same accelerator one,
    so the real path runs: AcceleratedOptimizer -> scaler.step -> fused AdamW that skips in-kernel."""
    model = tiny_llama()
    model.model.layers[1].mlp.act_fn = PoisonedSiLU()  # every backward is NaN, every forward finite
    trainer = Trainer(model=model, args=_args(max_steps=10, eval_strategy="steps", eval_steps=3),
                      train_dataset=TinyDataset(32), eval_dataset=TinyDataset(8, seed=1))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    watch = nbguard.watch(trainer)
    trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert watch.history.skipped_steps == list(range(10))
    alarms = [e for e in watch.events if e.kind != "scaler-skip"]  # every skipped step is also an event
    assert [e.kind for e in alarms] == ["frozen-eval-loss", "skipped-steps"], watch.summary()  # evals at 3, 6
    assert [e.step for e in watch.events if e.kind == "scaler-skip"] == list(range(10))
    skipped = alarms[1]
    assert skipped.step == 7 and skipped.evidence["scale_trend"][0] == 65536.0
    assert skipped.origin("backward").module == "model.layers.1.mlp.act_fn"
    assert alarms[0].evidence["evaluations"] == 2
    watch.detach()
    assert "update" not in vars(trainer.accelerator.scaler)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(100)]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return words, PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                          eos_token="<eos>")


def test_trl_sft_trainer_with_a_nan_embedding_row():
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    words, tokenizer = _tiny_tokenizer()
    gen = torch.Generator().manual_seed(0)
    # every example starts with "w7" (token id 10), whose embedding row is NaN
    texts = ["w7 " + " ".join(words[j] for j in torch.randint(0, 100, (10,), generator=gen).tolist())
             for _ in range(16)]
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[10] = float("nan")
    config = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                           report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, max_length=32)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer)
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    watch = nbguard.watch(trainer, policy="stop")
    trainer.train()
    assert trainer.state.global_step == 1
    [event] = watch.events
    assert event.kind == "nonfinite-loss" and event.cause == "nonfinite-parameter"
    origin = event.origin("forward")
    assert origin.module == "model.embed_tokens" and origin.tensor == "weight"
    assert torch.equal(before, model.model.layers[0].mlp.up_proj.weight)  # the bad update was dropped
    watch.detach()


def _masked_mean_loss(outputs, labels, num_items_in_batch=None):
    """A custom token-mean loss: sum(ce * mask) / mask.sum() is 0/0 when every label is -100."""
    logits, target = outputs.logits[:, :-1].float(), labels[:, 1:]
    mask = (target != -100).float().reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.clamp(min=0).reshape(-1),
                                           reduction="none")
    return (ce * mask).sum() / mask.sum()


def test_trainer_compute_loss_func_batch_without_labels_is_named_as_such():
    """compute_loss_func makes the Trainer pop the labels before the model sees them."""
    data = TinyDataset(8)
    for row in data.rows:
        row["labels"] = torch.full_like(row["labels"], -100)  # prompt-only rows: nothing supervised
    model = tiny_llama()
    trainer = Trainer(model=model, args=_args(max_steps=1), train_dataset=data, compute_loss_func=_masked_mean_loss)
    watch = nbguard.watch(trainer)
    trainer.train()
    event = watch.events[0]
    assert event.cause == "no-supervised-tokens" and event.origins == []
    assert event.evidence["micro_batches_without_labels"] == [0]
    watch.detach()
    assert "compute_loss" not in vars(trainer)  # the tap is gone; the class method answers again
