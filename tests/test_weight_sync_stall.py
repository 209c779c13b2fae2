"""Issue 43 item 2: the stall event names TRL's weight sync to vLLM when the training thread waits in it (trl#6796).

No vLLM here: the sync is TRL's real ``VLLMClient`` (built by its own constructor, which only checks that vLLM
is installed) talking HTTP to a local server that holds ``/start_weight_update`` open, as a vLLM server that
stopped answering does. The training thread then waits inside ``update_named_params`` with no timeout, which
is the wait trl#6796 reports. What is not reproduced: the NCCL broadcast after the request, which needs vLLM
(once the request returns, the client's broadcast raises NameError here, and the loop goes on).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_stall_watch import RELEASE_AFTER_S, Gate, kinds, loader, watched

pytest.importorskip("requests")
vllm_client = pytest.importorskip("trl.generation.vllm_client")


def vllm_like_server(hold: threading.Event | None) -> ThreadingHTTPServer:
    """Answers the client's health and model checks; a weight-update POST waits for ``hold`` first."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer({"data": [{"id": "tiny"}]} if self.path.startswith("/v1/models") else {})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            if hold is not None:
                hold.wait(RELEASE_AFTER_S)
            self._answer({})

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def client_factory(monkeypatch):
    # the constructor refuses without vLLM installed; everything it does besides that check runs for real
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    servers = []

    def make(hold: threading.Event | None):
        server = vllm_like_server(hold)
        servers.append(server)
        return vllm_client.VLLMClient(base_url=f"http://127.0.0.1:{server.server_address[1]}")

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


STALL_FLOOR_S = 1.0  # the bound's floor: 5 s before three step times are known, so a slow first step on a
# loaded machine is no stall of its own; past them the sync's silence is a stall after about a second


class SyncGate(Gate):
    """Released by the stall event that names the weight sync (a stall anywhere else leaves the sync waiting)."""

    def listener(self, watch, kind, payload) -> None:
        if kind == "event" and payload.kind == "stall" and "weight_sync" in payload.evidence:
            self.event.set()


def train_and_sync(model, optimizer, data, client, sync_at: int) -> list[str]:
    """A loop that pushes its weights to the engine before one step, as GRPO does before a generation."""
    outcomes = []
    for index, batch in enumerate(data):
        if index == sync_at:
            try:
                client.update_named_params([("lm_head.weight", "float32", list(model.lm_head.weight.shape))],
                                           iter([("lm_head.weight", model.lm_head.weight.detach())]))
            except NameError as exc:  # the NCCL broadcast after the request needs vLLM
                outcomes.append(str(exc))
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return outcomes


def test_a_weight_sync_the_server_never_answers_is_a_stall_that_names_the_sync_and_its_answered_twin_is_quiet(client_factory):
    model, optimizer, watch = watched(STALL_FLOOR_S)
    gate = SyncGate()
    watch.add_listener(gate.listener)
    client = client_factory(gate.event)  # the server answers the update once the stall event is recorded
    try:
        train_and_sync(model, optimizer, loader(8), client, sync_at=5)
    finally:
        watch.detach()
    assert gate.event.is_set(), "no stall event named the weight sync while it waited"
    assert kinds(watch) == ["stall"], watch.summary()
    event = watch.events[0]
    sync = event.evidence["weight_sync"]
    assert sync[0].startswith("update_named_params (trl/generation/vllm_client.py:")
    assert sync[-1].startswith("_start_weight_update (trl/generation/vllm_client.py:")
    assert "inside TRL's weight sync to the generation engine (update_named_params" in event.message
    assert "no timeout" in event.message and "vLLM server's log" in event.message
    assert event.evidence["collective"] is None
    assert "resumed at step 5" in event.message
    # its twin: the same loop and sync against a server that answers is quiet
    model, optimizer, watch = watched(STALL_FLOOR_S)
    try:
        outcomes = train_and_sync(model, optimizer, loader(8), client_factory(None), sync_at=5)
    finally:
        watch.detach()
    assert kinds(watch) == [], watch.summary()
    assert len(outcomes) == 1 and torch.isfinite(model.lm_head.weight).all()
