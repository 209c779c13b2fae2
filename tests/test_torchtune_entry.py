"""The watch on torchtune's own single-device LoRA recipe (torchtune 0.6, ``recipes/lora_finetune_single_device.py``,
loaded from the installed package as ``tune run`` loads it), unmodified: its ``setup(cfg)`` and ``train()`` on a
tiny OmegaConf config, with the plain-loop lines a user adds, ``nbguard.watch(recipe._model,
optimizer=recipe._optimizer, scheduler=recipe._lr_scheduler)`` after ``setup`` and ``watch.detach()`` after
``train``. No hub access: a tiny Llama-2-shaped LoRA model from torchtune's own builder, its base weights written
here as a torchtune checkpoint, a SentencePiece tokenizer trained here, an Alpaca-style JSON file. Runs in make
test-torchtune's venv (constraints/torchtune.txt); skipped where torchtune is not installed."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sysconfig

import pytest
import torch

import nbguard
from nbguard.watcher import RewindSettings

pytestmark = pytest.mark.torchtune
pytest.importorskip("torchtune")
torch.set_num_threads(1)

from omegaconf import OmegaConf  # noqa: E402

STEPS = 30
PLANTED = "layers.1.mlp"  # the module a NaN is planted in, as torchtune's TransformerDecoder names it
WORDS = "the a cat dog sat ran on under mat log red blue big small fast slow".split()
MODEL = {"vocab_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "embed_dim": 16, "max_seq_len": 64,
         "intermediate_dim": 32}


def _recipe_class():
    """The recipe as ``tune run`` finds it: a file of the installed package (``recipes`` is not importable)."""
    path = os.path.join(sysconfig.get_paths()["purelib"], "recipes", "lora_finetune_single_device.py")
    spec = importlib.util.spec_from_file_location("lora_finetune_single_device", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LoRAFinetuneRecipeSingleDevice


def _write_files(root):
    """A SentencePiece tokenizer.model, the base model's weights as a torchtune checkpoint, the data."""
    import sentencepiece as spm
    from torchtune.models.llama2 import llama2

    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(64):  # a task the tiny model learns within the run: say the words back
        words = " ".join(WORDS[i] for i in torch.randint(len(WORDS), (3,), generator=g))
        rows.append({"instruction": "repeat", "input": words, "output": words})
    (root / "data.json").write_text(json.dumps(rows))
    # three random words for one fixed prompt: the loss levels off at the words' own entropy, as a fine-tune's does
    # at its data's (the rows above are learned by heart, and their loss falls for as long as the run lasts)
    said = [{"input": "say three words", "output": " ".join(WORDS[i] for i in torch.randint(len(WORDS), (3,), generator=g))}
            for _ in range(64)]
    (root / "levelling.json").write_text(json.dumps(said))
    corpus = [f"{r['instruction']} {r['input']} Below is an instruction Response Input" for r in rows]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(root / "tokenizer"),
                                   vocab_size=MODEL["vocab_size"], model_type="bpe", character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, hard_vocab_limit=False,
                                   minloglevel=2)
    torch.manual_seed(1234)
    torch.save(llama2(**MODEL).state_dict(), root / "base.pt")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtune")
    _write_files(root)
    return root


def _config(root, out, epochs=1, lr=2e-2, levelling=False):
    """``levelling``: the rows of ``levelling.json`` through ``instruct_dataset``, the prompt masked (through
    ``alpaca_dataset`` every label was masked, the loss NaN: its template, in this 128-token vocabulary, leaves
    no room for the answer in 64 tokens)."""
    data = {"_component_": "torchtune.datasets.instruct_dataset", "data_files": str(root / "levelling.json"),
            "train_on_input": False} if levelling else \
        {"_component_": "torchtune.datasets.alpaca_dataset", "data_files": str(root / "data.json")}
    return OmegaConf.create({
        "output_dir": str(out), "device": "cpu", "dtype": "fp32", "seed": 0, "shuffle": True, "batch_size": 2,
        "epochs": epochs, "max_steps_per_epoch": STEPS, "gradient_accumulation_steps": 1, "clip_grad_norm": None,
        "compile": False, "resume_from_checkpoint": False, "save_adapter_weights_only": True,
        "enable_activation_checkpointing": False, "enable_activation_offloading": False, "log_every_n_steps": 1,
        "model": {"_component_": "torchtune.models.llama2.lora_llama2", **MODEL,
                  "lora_attn_modules": ["q_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
                  "apply_lora_to_output": True, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "tokenizer": {"_component_": "torchtune.models.llama2.llama2_tokenizer", "path": str(root / "tokenizer.model"),
                      "max_seq_len": 64},
        "checkpointer": {"_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                         "checkpoint_dir": str(root), "checkpoint_files": ["base.pt"], "output_dir": str(out),
                         "model_type": "LLAMA2"},
        "dataset": {"source": "json", **data, "packed": False},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": lr, "weight_decay": 0.01},
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 2},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(out / "logs")},
    })


class StepFaults:
    """Faults planted by the recipe's own step (``global_step``: the optimizer steps done), so the watch's
    replay of a step meets the same fault: a NaN out of ``PLANTED`` at ``nan_at``; the LR x1000 for steps
    ``spike_from`` .. ``spike_from + 2`` (the recipe's LambdaLR sets each step's LR afresh)."""

    def __init__(self, recipe, nan_at=None, spike_from=None):
        self.recipe, self.nan_at, self.spike_from, self.spiked_at = recipe, nan_at, spike_from, None
        recipe._model.get_submodule(PLANTED).register_forward_hook(self._nan)
        recipe._model.register_forward_pre_hook(self._lr)

    def _nan(self, module, args, out):
        return out * float("nan") if self.recipe.global_step == self.nan_at else out

    def _lr(self, module, args):
        step = self.recipe.global_step
        if self.spike_from is not None and self.spike_from <= step < self.spike_from + 3 and self.spiked_at != step:
            self.spiked_at = step
            for group in self.recipe._optimizer.param_groups:
                group["lr"] *= 1000


def _logged(out):
    """What the recipe's DiskLogger wrote: (step, loss) per optimizer step."""
    text = "".join(p.read_text() for p in sorted((out / "logs").glob("*.txt")))
    return [(int(step), float(loss)) for step, loss in re.findall(r"Step (\d+) \| loss:([-\d.eE+naif]+)", text)]


def _train(workdir, out, watched, nan_at=None, spike_from=None, run=None, **watch_options):
    cfg = _config(workdir, out, **(run or {}))
    recipe = _recipe_class()(cfg)
    recipe.setup(cfg)
    StepFaults(recipe, nan_at=nan_at, spike_from=spike_from)
    watch = nbguard.watch(recipe._model, optimizer=recipe._optimizer, scheduler=recipe._lr_scheduler,
                          log_to=None, verify=False, **watch_options) if watched else None
    recipe.train()
    if watch is not None:
        watch.detach()
    recipe.cleanup()
    return recipe, _logged(out), watch


def test_a_healthy_torchtune_recipe_is_bit_identical_to_an_unwatched_one_and_quiet(workdir, tmp_path):
    twin, twin_logged, _ = _train(workdir, tmp_path / "twin", watched=False)
    recipe, logged, watch = _train(workdir, tmp_path / "watched", watched=True)
    assert all(torch.equal(a, b) for a, b in zip(recipe._model.state_dict().values(),
                                                  twin._model.state_dict().values()))
    assert logged == twin_logged and len(logged) == STEPS
    assert watch.events == []
    # torchtune's own counters are left as they were: the recipe's step, the scheduler's position
    assert recipe.global_step == twin.global_step == STEPS
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    assert recipe._lr_scheduler.state_dict() == twin._lr_scheduler.state_dict()
    # each watched step's loss is the scalar the recipe started backward from, made outside the model: its chunked
    # CE on the logits times the step's token count (the recipe logs it divided back by that count)
    token_counts = [read / loss for read, (_, loss) in zip(watch.history.loss, logged, strict=True)]
    assert all(1 <= round(n) <= 2 * MODEL["max_seq_len"] and n == pytest.approx(round(n), rel=1e-4)
               for n in token_counts)


def test_a_nan_planted_in_a_torchtune_layer_is_caught_at_its_step_in_that_module(workdir, tmp_path):
    recipe, logged, watch = _train(workdir, tmp_path / "nan", watched=True, nan_at=12, policy="skip")
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 12)]
    assert bad[0].origins[0].module == PLANTED
    assert all(torch.isfinite(p).all() for p in recipe._model.parameters())
    assert recipe.global_step == STEPS  # the recipe counts the skipped step as it would any other


def test_an_lr_blow_up_in_a_torchtune_recipe_is_caught_as_divergence(workdir, tmp_path):
    recipe, _, watch = _train(workdir, tmp_path / "spike", watched=True, spike_from=15)
    diverged = [e.step for e in watch.events if e.kind == "divergence"]
    assert diverged and 15 <= diverged[0] <= 18
    assert not [e for e in watch.events if e.step < 15]
    assert recipe.global_step == STEPS


def _final_loss(logged):
    return sum(loss for _, loss in logged[-10:]) / 10


def test_rewind_brings_an_lr_blow_up_in_a_torchtune_recipe_back_to_the_healthy_runs_loss(workdir, tmp_path):
    # The same blow-up (LR x1000 for steps 15-17, then the schedule's own LR again), in a run a rescue can be measured
    # on. In the 30-step run above nothing could bring the final loss within 25% of the healthy twin's: the rows are
    # learned by heart until the cosine schedule reaches 0 at step 30, so every step lost costs final loss (rewound
    # 3.00 vs healthy 1.93; with no LR cut at all, 2.77). Here the loss levels off, as a fine-tune's does, and two
    # epochs (60 steps) leave steps after the blow-up to get there. Snapshots every 5 steps: the default 50 leaves
    # only the state before the first step to go back to in a run this short (rewound 3.80 vs 2.68).
    run = {"epochs": 2, "lr": 3e-2, "levelling": True}
    healthy, healthy_logged, _ = _train(workdir, tmp_path / "healthy", watched=False, run=run)
    _, ruined, _ = _train(workdir, tmp_path / "ruined", watched=False, spike_from=15, run=run)
    recipe, logged, watch = _train(workdir, tmp_path / "rewound", watched=True, spike_from=15, run=run,
                                   policy="rewind", rewind=RewindSettings(every=5))
    assert _final_loss(ruined) > 1.25 * _final_loss(healthy_logged)  # the ground truth: unwatched, it is ruined
    assert abs(_final_loss(logged) - _final_loss(healthy_logged)) <= 0.25 * _final_loss(healthy_logged)
    assert all(torch.isfinite(p).all() for p in recipe._model.parameters())
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert [e.evidence["trigger"] for e in rewinds][:1] == ["divergence"]
    assert all(e.evidence["restored"] and e.evidence["restored_after_step"] <= 14 for e in rewinds)  # before 15
    # torchtune's own counters move on as in the healthy run: the batches in between were dropped, not replayed
    assert recipe.global_step == healthy.global_step == 2 * STEPS
    assert [s for s, _ in logged] == [s for s, _ in healthy_logged] == list(range(1, 2 * STEPS + 1))
    assert recipe._lr_scheduler.last_epoch == healthy._lr_scheduler.last_epoch
