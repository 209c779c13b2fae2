"""The kernel side of the lab-extension comm, in a REAL ipykernel, with the test acting as the front end.

The test speaks the documented protocol (nbguard.notebook.comm) over a jupyter_client connection:
it sees the kernel's comm_open, answers hello, clicks "Insert cell" in the kernel, receives the
insert-cell message, and replies. The browser end is tested by the lab extension's own tests.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def kernel(tmp_path):
    spec = tmp_path / "kernels" / "nbguard-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbguard test", "language": "python"}))
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    km = KernelManager(kernel_name="nbguard-test", kernel_spec_manager=ksm)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    km.start_kernel(cwd=str(ROOT), env=env)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    yield Frontend(kc)
    kc.stop_channels()
    km.shutdown_kernel(now=True)


class Frontend:
    """Just enough of a Jupyter front end: execute cells, collect iopub, send comm messages."""

    def __init__(self, kc):
        self.kc = kc

    def execute(self, code: str, timeout: float = 120) -> list[dict]:
        msg_id = self.kc.execute(code)
        messages, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=timeout)
        errors = [m["content"] for m in messages if m["msg_type"] == "error"]
        assert reply["content"]["status"] == "ok", errors or reply["content"]
        return messages

    def comm_send(self, comm_id: str, data: dict) -> None:
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)

    def comm_close(self, comm_id: str) -> None:
        self.kc.shell_channel.send(self.kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))

    def value(self, expr: str):
        messages = self.execute(f"print(repr({expr}))")
        out = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
        return eval(out.strip())  # noqa: S307 - our own repr() of plain values


def _comm_opens(messages):
    return [m["content"] for m in messages if m["msg_type"] == "comm_open" and m["content"]["target_name"] == "nbguard"]


def _nbguard_docs(messages):
    return [m["content"]["data"]["application/vnd.nbguard.v1+json"] for m in messages
            if m["msg_type"] == "display_data" and "application/vnd.nbguard.v1+json" in m["content"]["data"]]


def test_hello_insert_cell_and_replies_over_a_real_kernel(kernel):
    import nbguard

    [opened] = _comm_opens(kernel.execute("%load_ext nbguard"))
    assert opened["data"] == {"action": "hello", "nbguard_version": nbguard.__version__}
    comm_id = opened["comm_id"]
    assert kernel.value("__import__('nbguard.notebook.comm').notebook.comm.CHANNEL.present") is False

    kernel.comm_send(comm_id, {"action": "hello", "extension_version": "0.1.0"})
    assert kernel.value("__import__('nbguard.notebook.comm').notebook.comm.CHANNEL.extension_version") == "0.1.0"

    # a plain PyTorch model has the finding and its fix: importing transformers was most of the kernel's CPU time
    messages = kernel.execute("import torch\nmy_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), "
                              "torch.nn.Linear(16, 8)).half()\n%precision_check my_model --hardware a100")
    [doc] = _nbguard_docs(messages)
    messages = kernel.execute(
        "from nbguard.notebook.present import OPEN_VIEWS\n"
        "row = OPEN_VIEWS[-1].fix_row('trainable-low-precision', 'upcast-trainable-fp32')\n"
        "row.insert_button.click()")
    sent = [m["content"]["data"] for m in messages if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id]
    assert len(sent) == 1
    assert sent[0]["action"] == "insert-cell" and sent[0]["output_id"] == doc["output_id"]
    assert sent[0]["run"] is False and "my_model" in sent[0]["code"]
    assert "Inserting" in kernel.value("row.result.value")

    kernel.comm_send(comm_id, {"action": "inserted", "output_id": doc["output_id"]})
    assert "Inserted a cell below" in kernel.value("row.result.value")

    kernel.execute("row.insert_button.click()")
    kernel.comm_send(comm_id, {"action": "error", "message": "no cell shows that output"})
    result = kernel.value("row.result.value")
    assert "Insert failed: no cell shows that output" in result and "<pre" in result  # falls back to the code

    kernel.comm_close(comm_id)  # the front end went away: back to the code block
    assert kernel.value("__import__('nbguard.notebook.comm').notebook.comm.CHANNEL.present") is False
    kernel.execute("row.insert_button.click()")
    assert "%nbguard fix upcast-trainable-fp32" in kernel.value("row.result.value")


def test_unload_closes_the_comm(kernel):
    [opened] = _comm_opens(kernel.execute("%load_ext nbguard"))
    messages = kernel.execute("%unload_ext nbguard")
    closes = [m for m in messages if m["msg_type"] == "comm_close" and m["content"]["comm_id"] == opened["comm_id"]]
    assert len(closes) == 1
    assert _comm_opens(kernel.execute("%load_ext nbguard"))  # a fresh hello after reloading
