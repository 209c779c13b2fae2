"""The watch on litgpt's own LoRA fine-tuning loop, ``litgpt.finetune.lora.fit`` (litgpt 0.5, a Fabric loop),
unmodified: everything ``litgpt.finetune.lora.main`` does before ``fit`` is done here with litgpt's own functions
(its tokenizer, its JSON data module and dataloaders, its LoRA ``GPT`` from a tiny ``Config``, Fabric's setup,
its optimizer, its scheduler, its checkpoint loader reading a ``lit_model.pth`` written here), then the one line
a user adds after ``fabric.setup``: ``nbguard.watch(model, optimizer=optimizer, scheduler=scheduler)`` on what
Fabric returned (the scheduler: the one a rewind cuts the LR of).
No hub access: the checkpoint directory (tokenizer, weights) and the data are written locally. Runs in make
test-litgpt's venv (constraints/litgpt.txt); skipped where litgpt is not installed."""
from __future__ import annotations

import json

import pytest
import torch

import nbguard
from nbguard.watcher import RewindSettings

pytestmark = pytest.mark.litgpt
pytest.importorskip("litgpt")
lora_script = pytest.importorskip("litgpt.finetune.lora")
torch.set_num_threads(1)

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import Logger  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.data import JSON  # noqa: E402
from litgpt.lora import GPT, Config, mark_only_lora_as_trainable  # noqa: E402
from litgpt.prompts import Default  # noqa: E402
from litgpt.tokenizer import Tokenizer  # noqa: E402
from litgpt.utils import instantiate_torch_optimizer, load_checkpoint  # noqa: E402

STEPS = 30
PLANTED = "transformer.h.1.mlp"  # the module a NaN is planted in, as the user's GPT names it
WORDS = "the a cat dog sat ran on under mat log red blue big small fast slow".split()


class RecordingLogger(Logger):
    """Fabric's logger interface, kept in memory: what ``fit`` logs (its own ``step`` counter above all)."""

    def __init__(self):
        super().__init__()
        self.metrics: list[dict] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _write_checkpoint_dir(root):
    """A litgpt checkpoint directory as ``litgpt download`` leaves one, tiny: an HF tokenizer.json with its
    tokenizer_config.json (bos/eos), and the base model's ``lit_model.pth``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = sorted(set("".join(WORDS)) | set(".:#,!?'-_()[]0123456789") | set("abcdefghijklmnopqrstuvwxyz"))
    alphabet += [c.upper() for c in alphabet if c.isalpha()]
    vocab = {token: i for i, token in enumerate(specials + WORDS + sorted(set(alphabet) - set(WORDS)))}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Split("", "isolated")])
    hf.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "add_bos_token": True,
                                                             "tokenizer_class": "PreTrainedTokenizerFast"}))
    config = _config(len(vocab))
    torch.manual_seed(1234)
    torch.save(GPT(config).state_dict(), root / "lit_model.pth")
    return len(vocab)


def _config(vocab_size):
    return Config(n_layer=2, n_head=2, n_embd=16, block_size=64, vocab_size=vocab_size, padded_vocab_size=vocab_size,
                  intermediate_size=32, bias=False, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True,
                  lora_mlp=True, lora_head=True)


def _write_data(path):
    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(48):  # a task the tiny model learns within the run: say the words back
        words = " ".join(WORDS[i] for i in torch.randint(len(WORDS), (3,), generator=g))
        rows.append({"instruction": "repeat", "input": words, "output": words})
    path.write_text(json.dumps(rows))


def _write_levelling_data(path):
    """Rows whose answer is three random words for one fixed prompt: the loss levels off at the words' own
    entropy, as a fine-tune's does at its data's, instead of falling for as long as the run lasts (the rows of
    ``_write_data`` never reach the model: litgpt's Alpaca template, spelled out character by character by this
    tokenizer, fills the 64 tokens, and the run memorises that one string to the end)."""
    g = torch.Generator().manual_seed(11)
    rows = [{"instruction": "say three words", "input": "",
             "output": " ".join(WORDS[i] for i in torch.randint(len(WORDS), (3,), generator=g))} for _ in range(48)]
    path.write_text(json.dumps(rows))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("litgpt")
    (root / "checkpoint").mkdir()
    vocab_size = _write_checkpoint_dir(root / "checkpoint")
    _write_data(root / "data.json")
    _write_levelling_data(root / "levelling.json")
    return root, vocab_size


class StepFaults:
    """Faults planted by the optimizer step they belong to (the scheduler's count: ``fit`` steps it once per
    optimizer step), so the watch's replay of a step meets the same fault: a NaN out of ``PLANTED`` at
    ``nan_at``; the LR x1000 for optimizer steps ``spike_from`` .. ``spike_from + 2``."""

    def __init__(self, model, optimizer, scheduler, nan_at=None, spike_from=None):
        self.optimizer, self.scheduler, self.nan_at, self.spike_from = optimizer, scheduler, nan_at, spike_from
        self.spiked = False
        model.get_submodule(PLANTED).register_forward_hook(self._nan)
        model.register_forward_pre_hook(self._lr)

    def _nan(self, module, args, out):
        return out * float("nan") if module.training and self.scheduler.last_epoch == self.nan_at else out

    def _lr(self, module, args):
        if self.spike_from is None or not module.training:
            return
        inside = self.spike_from <= self.scheduler.last_epoch < self.spike_from + 3
        if inside != self.spiked:
            self.spiked = inside
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * 1000 if inside else group["lr"] / 1000


def _finetune(workdir, watched, nan_at=None, spike_from=None, steps=STEPS, lr=2e-2, levelling=False, **watch_options):
    """litgpt's ``main`` up to ``fit`` (the same calls, in its order), the watch attached after Fabric's setup,
    then litgpt's ``fit``. Returns the user's GPT, what ``fit`` logged, the scheduler, the watch. ``levelling``:
    the rows of ``_write_levelling_data``, the prompt as written (litgpt's ``Default`` style) and masked."""
    root, vocab_size = workdir
    checkpoint_dir = root / "checkpoint"
    logger = RecordingLogger()
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", loggers=[logger])
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=2, micro_batch_size=2, lr_warmup_steps=2,
                      epochs=1000, max_steps=steps, max_seq_length=64)
    eval_args = EvalArgs(interval=10**6, max_new_tokens=4, max_iters=1, initial_validation=False,
                         final_validation=False)
    data = JSON(json_path=root / "levelling.json", val_split_fraction=0.125, num_workers=0, prompt_style=Default(),
                mask_prompt=True) if levelling else \
        JSON(json_path=root / "data.json", val_split_fraction=0.125, num_workers=0)

    tokenizer = Tokenizer(checkpoint_dir)
    train_loader, val_loader = lora_script.get_dataloaders(fabric, data, tokenizer, train)
    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=False):
        gpt = GPT(_config(vocab_size))
    mark_only_lora_as_trainable(gpt)
    model = fabric.setup_module(gpt)
    optimizer = instantiate_torch_optimizer({"class_path": "torch.optim.AdamW", "init_args": {"lr": lr}},
                                            model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = lora_script.get_lr_scheduler(optimizer, warmup_steps=train.lr_warmup_steps, max_steps=steps)
    load_checkpoint(fabric, model, checkpoint_dir / "lit_model.pth", strict=False)
    StepFaults(gpt, optimizer, scheduler, nan_at=nan_at, spike_from=spike_from)

    watch = nbguard.watch(model, optimizer=optimizer, scheduler=scheduler, log_to=None, verify=False,
                          **watch_options) if watched else None
    lora_script.fit(fabric=fabric, model=model, optimizer=optimizer, scheduler=scheduler, train_dataloader=train_loader,
                    val_dataloader=val_loader, devices=1, checkpoint_dir=checkpoint_dir, out_dir=root / "out",
                    train=train, eval=eval_args, data=data)
    if watch is not None:
        watch.detach()
    logged = [m for m in logger.metrics if "step" in m]
    return gpt, logged, scheduler, watch


def test_a_healthy_litgpt_finetune_is_bit_identical_to_an_unwatched_one_and_quiet(workdir):
    twin, twin_logged, twin_scheduler, _ = _finetune(workdir, watched=False)
    gpt, logged, scheduler, watch = _finetune(workdir, watched=True)
    assert all(torch.equal(a, b) for a, b in zip(gpt.state_dict().values(), twin.state_dict().values()))
    assert [m["loss"] for m in logged] == [m["loss"] for m in twin_logged]
    assert watch.events == []
    # litgpt's own counters are left as they were: fit's step and iteration, the scheduler's position
    assert [(m["step"], m["iter"]) for m in logged] == [(m["step"], m["iter"]) for m in twin_logged]
    assert logged[-1]["step"] == STEPS
    assert scheduler.state_dict() == twin_scheduler.state_dict()
    # each watched step's loss is the one fit computed outside the model (chunked_cross_entropy of its logits)
    assert watch.history.loss == pytest.approx([m["loss"] for m in logged], rel=1e-5)


def test_a_nan_planted_in_a_litgpt_block_is_caught_at_its_step_named_without_fabrics_wrapper(workdir):
    gpt, logged, _, watch = _finetune(workdir, watched=True, nan_at=12, policy="skip")
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 12)]
    assert bad[0].origins[0].module == PLANTED  # not _forward_module.transformer.h.1.mlp
    assert all(torch.isfinite(p).all() for p in gpt.parameters())
    assert logged[-1]["step"] == STEPS  # fit counts the skipped step as it would any other


def test_an_lr_blow_up_in_a_litgpt_finetune_is_caught_as_divergence(workdir):
    _, logged, _, watch = _finetune(workdir, watched=True, spike_from=15)
    diverged = [e.step for e in watch.events if e.kind == "divergence"]
    assert diverged and 15 <= diverged[0] <= 18
    assert not [e for e in watch.events if e.step < 15]
    assert logged[-1]["step"] == STEPS


def _final_loss(logged):
    return sum(m["loss"] for m in logged[-10:]) / 10


def test_rewind_brings_an_lr_blow_up_in_a_litgpt_finetune_back_to_the_healthy_runs_loss(workdir):
    # The same blow-up (LR x1000 for optimizer steps 15-17, then the schedule's own LR again), in a run a rescue can
    # be measured on. In the 30-step run above nothing could bring the final loss within 25% of the healthy twin's:
    # the run memorises one string until its cosine schedule reaches 0 at step 30, so every step lost costs final
    # loss (rewound 2.68 vs healthy 1.87; with no LR cut at all, 2.45). Here the loss levels off, as a fine-tune's
    # does, and there are steps after the blow-up to get there. Snapshots every 5 steps: the default 50 is longer
    # than this run, which leaves only the state before the first step to go back to (rewound 3.91 vs 1.91).
    levelling = {"steps": 60, "lr": 3e-2, "levelling": True}
    _, healthy, healthy_scheduler, _ = _finetune(workdir, watched=False, **levelling)
    _, ruined, _, _ = _finetune(workdir, watched=False, spike_from=15, **levelling)
    gpt, logged, scheduler, watch = _finetune(workdir, watched=True, spike_from=15, policy="rewind",
                                              rewind=RewindSettings(every=5), **levelling)
    assert _final_loss(ruined) > 1.25 * _final_loss(healthy)  # the ground truth: unwatched, the blow-up ruins it
    assert abs(_final_loss(logged) - _final_loss(healthy)) <= 0.25 * _final_loss(healthy)
    assert all(torch.isfinite(p).all() for p in gpt.parameters())
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert [e.evidence["trigger"] for e in rewinds][:1] == ["divergence"]
    assert all(e.evidence["restored"] and e.evidence["restored_after_step"] <= 14 for e in rewinds)  # before 15
    # litgpt's own counters move on as in the healthy run: the batches in between were dropped, not replayed
    assert [(m["step"], m["iter"]) for m in logged] == [(m["step"], m["iter"]) for m in healthy]
    assert scheduler.last_epoch == healthy_scheduler.last_epoch == 60
