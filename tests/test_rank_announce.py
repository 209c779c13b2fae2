"""A rank says it watches through the process group's store, and that word must be stored before the rank
trains on: TCPStore's set only sends, so a peer's check could be answered first and the peer would watch
alone while this rank waits in the step's exchange (a hang seen once with both cores busy)."""
from __future__ import annotations

import socket

import torch.distributed as dist

from nbguard.watcher.distributed.ranks import _stored


class SendOnlyStore:
    """TCPStore's protocol as a peer sees it: a set is only sent; the server reads it when it next serves
    this connection (a request that waits for its reply: check, get)."""

    def __init__(self):
        self.server: dict[str, str] = {}
        self.sent: list[tuple[str, str]] = []

    def set(self, key, value):
        self.sent.append((key, value))

    def check(self, keys):
        self.server.update(self.sent)  # replies on one connection come after its earlier requests
        self.sent.clear()
        return all(k in self.server for k in keys)

    def peer_sees(self, key) -> bool:
        return key in self.server


def test_announcing_waits_until_the_store_holds_the_key():
    store = SendOnlyStore()
    assert _stored(store, "nbguard/watch/1/0")
    assert store.peer_sees("nbguard/watch/1/0")  # a set alone would leave the peer's check False


def test_on_a_real_tcp_store_a_second_client_sees_the_key():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    peer = dist.TCPStore("127.0.0.1", port, 2, False)
    assert _stored(server, "nbguard/watch/1/1")
    assert peer.check(["nbguard/watch/1/1"])


def test_a_store_that_fails_is_not_relied_on():
    class Broken(SendOnlyStore):
        def set(self, key, value):
            raise RuntimeError("connection reset")

    assert not _stored(Broken(), "nbguard/watch/1/0")
