"""nbguard's scalars and events in TensorBoard event files, read back with TensorBoard's own reader:
a plain loop (SummaryWriter), accelerate's tensorboard tracker, and a Trainer with report_to."""
import pytest

pytest.importorskip("tensorboard")
from notebook_helpers import run, shell  # noqa: E402,F401
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402
from trackers_helpers import BAD_STEP, assert_matches_history, plain_run, trainer_run  # noqa: E402


def _read(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, prefix: str = "") -> dict[int, dict[str, float]]:
    """step -> {tag without ``prefix``: value} for every scalar tag under ``prefix + "nbguard/"``."""
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        if tag.startswith(prefix + "nbguard/"):
            for point in acc.Scalars(tag):
                out.setdefault(point.step, {})[tag[len(prefix):]] = point.value
    return out


def _texts(acc, tag: str) -> list[tuple[int, str]]:
    return [(t.step, tensor_util.make_ndarray(t.tensor_proto).item().decode()) for t in acc.Tensors(tag)]


def test_plain_loop_healthy_scalars_match_the_watch_history(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    watch = plain_run(writer, steps=4)
    writer.close()
    acc = _read(tmp_path)
    assert_matches_history(_scalars(acc), watch)
    assert all(row["nbguard/skipped_steps"] == 0 and row["nbguard/events"] == 0 for row in _scalars(acc).values())
    assert "nbguard/events/text_summary" not in acc.Tags()["tensors"]


def test_plain_loop_planted_nan_is_a_text_event_and_a_skipped_step(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    watch = plain_run(writer, steps=4, bad_step=BAD_STEP, every=10)
    writer.close()
    acc = _read(tmp_path)
    [(step, text)] = _texts(acc, "nbguard/events/text_summary")
    assert step == BAD_STEP and text.startswith("**nonfinite-grad** at step 2") and "model.layers.1.mlp.act_fn" in text
    scalars = _scalars(acc)
    # every=10 logs step 0, and the event's step at once, with its NaN norms and the count
    assert sorted(scalars) == [0, BAD_STEP]
    assert scalars[BAD_STEP]["nbguard/events/nonfinite-grad"] == 1 and scalars[BAD_STEP]["nbguard/skipped_steps"] == 1
    assert scalars[BAD_STEP]["nbguard/total_grad_norm"] != scalars[BAD_STEP]["nbguard/total_grad_norm"]  # NaN
    assert watch.history.skipped_steps == [BAD_STEP]


def test_grad_scaler_loop_logs_loss_scale_and_activation_headroom(tmp_path):
    import torch

    writer = SummaryWriter(str(tmp_path))
    watch = plain_run(writer, steps=3, scaler=torch.amp.GradScaler("cpu"), activations=True)
    writer.close()
    scalars = _scalars(_read(tmp_path))
    assert [scalars[s]["nbguard/loss_scale"] for s in (0, 1, 2)] == watch.history.loss_scale
    history = watch.activation_history
    for i, step in enumerate(history.steps):  # fp16's limit over the largest activation of the step
        largest = max(history.absmax(g)[i] for g in history.groups)
        assert scalars[step]["nbguard/activation_headroom"] == pytest.approx(65504.0 / largest, rel=1e-6)


def test_accelerator_log_carries_the_same_names_and_the_event_text(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    watch = plain_run(accelerator, steps=4, bad_step=BAD_STEP)
    accelerator.end_training()
    acc = _read(tmp_path / "run")
    scalars = _scalars(acc)
    assert sorted(scalars) == [0, 1, 2, 3]
    assert scalars[1]["nbguard/loss"] == pytest.approx(watch.history.loss[1], rel=1e-6)
    assert scalars[BAD_STEP]["nbguard/events"] == 1
    [(step, text)] = _texts(acc, "nbguard/events/text_summary")
    assert step == BAD_STEP and "nonfinite-grad" in text


def test_trainer_report_to_tensorboard_gets_scalars_event_text_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer, watch = trainer_run(["tensorboard"], steps=4, bad_step=BAD_STEP, output_dir=str(tmp_path))
    acc = _read(tmp_path / "tb")
    scalars = _scalars(acc, "train/")
    # the Trainer logs global_step g after watch step g - 1; the healthy steps match the history
    healthy = [s for s in watch.history.steps if s != BAD_STEP]
    for step in healthy:
        row = scalars[step + 1]
        assert row["nbguard/loss"] == pytest.approx(watch.history.loss[step], rel=1e-6)
        assert row["nbguard/grad_norm/lm_head"] == pytest.approx(
            watch.history.grad_norm("lm_head")[step], rel=1e-6)
    assert scalars[BAD_STEP + 1]["nbguard/events/nonfinite-grad"] == 1
    [(step, text)] = _texts(acc, "train/nbguard/event/text_summary")
    assert step == BAD_STEP + 1 and text.startswith("**nonfinite-grad** at step 2")
    [(_, report)] = _texts(acc, "nbguard/report/text_summary")
    assert "model.layers.1.mlp.act_fn" in report  # the origin the replay found, in the report
    assert not (tmp_path / "nbguard-report.html").exists()  # nothing in output_dir unless asked (save_report)



def test_cell_nanwatch_log_to_names_the_writer(shell, tmp_path):
    shell.user_ns["logdir"] = str(tmp_path)
    run(shell, "import torch\nfrom torch.utils.tensorboard import SummaryWriter\n"
               "from nbguard.testing import tiny_llama, tiny_batch\nnet = tiny_llama()\n"
               "opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\nbatch = tiny_batch()\nwriter = SummaryWriter(logdir)")
    cell = run(shell, "%%nanwatch net --log-to writer\nfor i in range(2):\n    net(**batch).loss.backward()\n"
                      "    opt.step()\n    opt.zero_grad()\nwriter.flush()")
    assert cell.result.success
    assert sorted(_scalars(_read(tmp_path))) == [0]  # the default rate: every 10th step from step 0
    bad = run(shell, "%nanwatch net --log-to no_such_writer")
    assert "no variable named 'no_such_writer'" in bad.stdout + bad.stderr


@pytest.mark.parametrize("log_to", ["default", None])
def test_trl_sft_trainer_report_to_tensorboard_matches_the_history(tmp_path, monkeypatch, log_to):
    """With no extra code (the default log_to) a watched SFT run's TensorBoard holds nbguard's scalars;
    log_to=None turns that off and the Trainer's own logs stay as they were."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from data_helpers import word_tokenizer

    import nbguard
    from nbguard.testing import tiny_llama

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    texts = [" ".join(f"w{3 + (i * 7 + j) % 100}" for j in range(10)) for i in range(8)]
    config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                           report_to=["tensorboard"], save_strategy="no", logging_steps=1, disable_tqdm=True,
                           max_length=16)
    trainer = trl.SFTTrainer(model=tiny_llama(), args=config, processing_class=word_tokenizer(),
                             train_dataset=datasets.Dataset.from_dict({"text": texts}))
    watch = nbguard.watch(trainer, verify=False) if log_to == "default" else nbguard.watch(trainer, verify=False,
                                                                                            log_to=None)
    trainer.train()
    watch.detach()
    acc = _read(tmp_path / "tb")
    if log_to is None:
        assert _scalars(acc, "train/") == {} and "train/loss" in acc.Tags()["scalars"]
        return
    # the Trainer logs global_step g after the watch's step g - 1
    assert_matches_history(_scalars(acc, "train/"), watch, step_offset=1)
