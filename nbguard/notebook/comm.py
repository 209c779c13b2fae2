"""The comm between the kernel and nbguard's JupyterLab / Notebook 7 extension.

Protocol (version 1; every message is a JSON object with an ``action`` key):

* The front end registers the comm target ``"nbguard"`` on every kernel it connects to.
* On ``%load_ext nbguard`` the kernel opens a comm to that target with the open data
  ``{"action": "hello", "nbguard_version": "<x.y.z>"}``.
* The front end answers on that comm ``{"action": "hello", "extension_version": "<x.y.z>"}``.
  Only after this answer does the kernel consider the extension present. Where no extension is
  installed the target is unknown and the front end closes the comm (or never answers).
* To insert a cell the kernel sends ``{"action": "insert-cell", "code": str, "output_id": str,
  "run": bool}``. The front end inserts a code cell holding ``code`` directly below the cell whose
  outputs contain the nbguard document (MIME ``application/vnd.nbguard.v1+json``) whose
  ``output_id`` equals the one sent, runs it when ``run`` is true, and replies
  ``{"action": "inserted", "output_id": str}`` or ``{"action": "error", "message": str}``
  (an error reply may carry ``output_id`` too).
* Closing: the kernel closes the comm on ``%unload_ext nbguard``; when the front end closes it,
  the kernel marks the extension absent again.

No comm is opened where no front end can answer: without a kernel (terminal IPython) and in
Colab. Without a hello, "Insert cell" buttons fall back to a code block to copy. The comm is opened with
the ``comm`` package (ipykernel >= 6.18) or ``ipykernel.comm.Comm`` (ipykernel 6.17, as in Colab).
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from ..document.outward import outward

TARGET_NAME = "nbguard"

Reply = Callable[[dict[str, Any]], None]


def _comm_factory():
    """``create(target_name=, data=)`` for this kernel's comm implementation."""
    from ..environment import parsed_version

    ipykernel_version = parsed_version("ipykernel")
    if ipykernel_version is not None and ipykernel_version.release >= (6, 18):
        import comm

        return comm.create_comm
    from ipykernel.comm import Comm

    return Comm


class LabChannel:
    """The kernel end of the comm; one per kernel process (``CHANNEL``)."""

    def __init__(self) -> None:
        self.comm: Any = None  # a comm.base_comm.BaseComm (or ipykernel's Comm) once open
        self.extension_version: str | None = None
        self._pending: dict[str, deque[Reply]] = defaultdict(deque)

    @property
    def present(self) -> bool:
        """True once the front end answered the hello."""
        return self.comm is not None and self.extension_version is not None

    def open(self, shell) -> bool:
        """Say hello to the front end; False where there is no kernel (a terminal IPython)."""
        if self.comm is not None:
            return True
        if getattr(shell, "kernel", None) is None:
            return False
        from .display import in_colab

        if in_colab():
            return False  # Colab's front end runs no JupyterLab extensions: nothing would answer
        from ..document import __version__

        self.comm = _comm_factory()(target_name=TARGET_NAME, data={"action": "hello", "nbguard_version": __version__})
        self.comm.on_msg(self._on_msg)
        self.comm.on_close(self._on_close)
        return True

    def close(self) -> None:
        comm, self.comm = self.comm, None
        self.extension_version = None
        self._fail_pending("the nbguard extension was unloaded")
        if comm is not None:
            comm.close()

    def insert_cell(self, code: str, output_id: str, run: bool = False, on_reply: Reply | None = None) -> bool:
        """Ask the front end to insert ``code`` below the cell showing ``output_id``; False if absent."""
        if not self.present:
            return False
        if on_reply is not None:
            self._pending[output_id].append(on_reply)
        # the cell as the card shows it (documents are redacted at the same boundary): shown and inserted are one text
        self.comm.send(outward({"action": "insert-cell", "code": code, "output_id": output_id, "run": bool(run)}))
        return True

    # -- messages from the front end ------------------------------------------------------------
    def _on_msg(self, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data", {}) or {}
        action = data.get("action")
        if action == "hello":
            self.extension_version = str(data.get("extension_version") or "unknown")
        elif action in ("inserted", "error"):
            self._reply(data)

    def _on_close(self, msg: dict[str, Any] | None = None) -> None:
        self.comm = None
        self.extension_version = None
        self._fail_pending("the front end closed the nbguard comm")

    def _reply(self, data: dict[str, Any]) -> None:
        output_id: Any = data.get("output_id")
        if output_id is None and data.get("action") == "error" and len(self._pending) == 1:
            output_id = next(iter(self._pending))  # an error without an id can only be the one request
        queue = self._pending.get(output_id)
        if not queue:
            return
        callback = queue.popleft()
        if not queue:
            del self._pending[output_id]
        callback(data)

    def _fail_pending(self, message: str) -> None:
        pending, self._pending = self._pending, defaultdict(deque)
        for output_id, queue in pending.items():
            for callback in queue:
                callback({"action": "error", "output_id": output_id, "message": message})


CHANNEL = LabChannel()
