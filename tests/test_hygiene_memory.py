"""Memory comes back: after nbguard audited, watched and reported on a model, ``del`` frees it.

Each test keeps only a ``weakref`` to the user's model, deletes the user's names in a real
IPython shell (output history cleared, as ``%reset -f out`` does) and checks the model was
collected. The negative side: while the model is alive, the views nbguard left behind still act
on it; once it is gone they say so instead of failing obscurely.
"""
from __future__ import annotations

import gc
import weakref

import pytest
from notebook_helpers import run, shell  # noqa: F401
from test_notebook_comm import _comm_opens, _nbguard_docs, kernel  # noqa: F401  (the real-kernel fixture)

import nbguard
from nbguard.session import SESSION

TRAINER_SETUP = """
import torch
from transformers import Trainer, TrainingArguments
from nbguard.testing import tiny_llama, TinyDataset
model = tiny_llama(dtype=torch.float16)
trainer = Trainer(model=model, train_dataset=TinyDataset(8),
                  args=TrainingArguments(output_dir={out!r}, use_cpu=True, report_to=[], max_steps=3,
                                         per_device_train_batch_size=2, save_strategy="no",
                                         logging_strategy="no", disable_tqdm=True))
"""
LOOP_SETUP = """
import torch
from nbguard.testing import tiny_llama, tiny_batch
net = tiny_llama()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
batch = tiny_batch()
def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        net(**batch).loss.backward()
        opt.step()
"""


def _ok(cell):
    assert cell.error is None, (cell.error, cell.stderr)
    return cell


def _collected(ip, ref: weakref.ref, names: str) -> bool:
    _ok(run(ip, f"%reset -f out\ndel {names}"))
    ip.user_ns.pop("_", None), ip.user_ns.pop("__", None), ip.user_ns.pop("___", None)
    gc.collect()
    return ref() is None


def test_audit_watched_train_report_and_displays_leave_the_model_collectable(shell, tmp_path):
    _ok(run(shell, TRAINER_SETUP.format(out=str(tmp_path / "out"))))
    ref = weakref.ref(shell.user_ns["model"])
    _ok(run(shell, "%precision_check model --hardware t4"))
    from nbguard.notebook.present import OPEN_VIEWS

    view = OPEN_VIEWS[-1]
    view.fix_row("trainable-low-precision", "upcast-trainable-fp32").apply()  # Apply + re-audit, in the kernel
    assert "trainable-low-precision" in view.resolved  # applied to the live model, re-audited: gone
    cell = _ok(run(shell, "%%nanwatch trainer\ntrainer.train()"))
    assert cell.updated_docs[-1]["history"]["steps"] == [0, 1, 2]  # the view's; the printed line says it detached
    _ok(run(shell, f"%nbguard report {tmp_path / 'r.html'}"))
    _ok(run(shell, "import nbguard\ndisplay(nbguard.report())\nnbguard.report()"))  # displayed and an Out value
    del view
    assert ref() is not None  # the user's names still hold it
    assert _collected(shell, ref, "model, trainer")
    # ...and the session still tells the story, as data
    kinds = [e.kind for e in SESSION.timeline]
    assert kinds[:3] == ["audit", "fix", "audit"] and "watch" in kinds
    watch_doc = SESSION.entries("watch")[-1].document()
    assert watch_doc["kind"] == "watch" and watch_doc["history"]["steps"] == [0, 1, 2]


def test_a_view_acts_on_the_live_model_and_says_so_once_it_is_deleted(shell):
    _ok(run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nm = tiny_llama(dtype=torch.float16)"))
    _ok(run(shell, "%precision_check m --hardware t4"))
    from nbguard.notebook.present import OPEN_VIEWS

    view = OPEN_VIEWS[-1]
    ref = weakref.ref(shell.user_ns["m"])
    assert _collected(shell, ref, "m")
    row = view.fix_row("trainable-low-precision", "upcast-trainable-fp32")
    row.apply()
    assert "&#x27;m&#x27; no longer exists" in row.result.value and row.apply_button.description == "Apply"


def test_plain_loop_watch_with_line_magic_and_with_block(shell):
    _ok(run(shell, LOOP_SETUP))
    ref = weakref.ref(shell.user_ns["net"])
    _ok(run(shell, "%nanwatch net"))
    _ok(run(shell, "train(2)"))
    _ok(run(shell, "%nanwatch off"))
    _ok(run(shell, "import nbguard\nwith nbguard.watch(net, optimizer=opt) as w:\n    train(1)"))
    assert SESSION.watches[-1] is shell.user_ns["w"]  # alive: the live watch
    assert _collected(shell, ref, "net, opt, w, batch, train")
    assert [d["history"]["steps"] for d in SESSION.watches] == [[0, 1], [0]]  # now only documents


def test_a_watch_still_attached_when_the_model_is_deleted_leaves_its_document():
    import torch

    from nbguard.testing import tiny_batch, tiny_llama

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt)
    for _ in range(2):
        opt.zero_grad()
        model(**tiny_batch()).loss.backward()
        opt.step()
    assert watch.attached and SESSION.watches == [watch]
    ref = weakref.ref(model)
    del model, opt, watch
    gc.collect()
    assert ref() is None  # no detach, and still collectable: nbguard held it only weakly
    [doc] = SESSION.watches
    assert doc["kind"] == "watch" and doc["history"]["steps"] == [0, 1]


def test_the_attached_watch_map_holds_no_watch_once_detached():
    import torch

    from nbguard.testing import tiny_llama
    from nbguard.watcher.core.lifecycle import _ATTACHED, attached_watch, attached_watches

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt)
    assert attached_watch(model) is watch and watch in attached_watches()
    assert isinstance(_ATTACHED[model], weakref.ref)  # the value does not hold its key alive
    watch.detach()
    assert attached_watch(model) is None and model not in _ATTACHED
    assert watch not in attached_watches()


def test_lab_comm_path_leaves_the_model_collectable(kernel, tmp_path):
    """A real ipykernel with the test as the JupyterLab front end: hello, Insert cell, watch, report."""
    [opened] = _comm_opens(kernel.execute("%load_ext nbguard"))
    kernel.comm_send(opened["comm_id"], {"action": "hello", "extension_version": "0.1.0"})
    assert kernel.value("__import__('nbguard.notebook.comm').notebook.comm.CHANNEL.present") is True
    kernel.execute(TRAINER_SETUP.format(out=str(tmp_path / "out")))
    [doc] = _nbguard_docs(kernel.execute("%precision_check trainer --hardware t4"))
    kernel.execute("from nbguard.notebook.present import OPEN_VIEWS\n"
                   "OPEN_VIEWS[-1].fix_row('trainable-low-precision', 'upcast-trainable-fp32').insert_button.click()")
    kernel.execute("%%nanwatch trainer\ntrainer.train()")
    kernel.execute(f"%nbguard report {tmp_path / 'r.json'}")
    kernel.execute("import gc, weakref\nref = weakref.ref(model)\nnbguard_report = __import__('nbguard').report()\n"
                   "nbguard_report")  # a report as an Out value too
    assert kernel.value("ref() is None") is False
    kernel.execute("%reset -f out\ndel model, trainer\ngc.collect()")
    assert kernel.value("ref() is None") is True  # an Insert-cell request still pending, and freed
    kernel.comm_send(opened["comm_id"], {"action": "inserted", "output_id": doc["output_id"]})
    assert kernel.value("len(__import__('nbguard.session').session.SESSION.watches)") == 1


def test_a_trainer_watch_never_detached_frees_trainer_and_model(tmp_path):
    """The README's `nbguard.watch(trainer); trainer.train()`, with no detach, then `del`."""
    from transformers import Trainer, TrainingArguments

    from nbguard.testing import TinyDataset, tiny_llama

    model = tiny_llama()
    trainer = Trainer(model=model, train_dataset=TinyDataset(8),
                      args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2,
                                             per_device_train_batch_size=2, save_strategy="no",
                                             logging_strategy="no", disable_tqdm=True))
    nbguard.watch(trainer)
    trainer.train()
    ref = weakref.ref(model)
    del model, trainer
    gc.collect()
    assert ref() is None
    [doc] = SESSION.watches
    assert doc["history"]["steps"] == [0, 1]
