"""What dynamo's failed guards say: why ``torch.compile`` compiled a function again, and what to change.

Dynamo keeps the reason of every guard that failed, by code object (``torch._dynamo.utils.guard_failures``,
``0/3: tensor 'x' size mismatch at index 0. expected 3, actual 4``). The watch's step clock and the
explainer's recompile-limit signature read them; nothing here imports torch (where dynamo is not loaded
nothing was compiled, and there is nothing to read).
"""
from __future__ import annotations

import re
import sys
from typing import Any

_COMPILE_ID = re.compile(r"^\s*\[?\d+/\d+\]?:\s*")  # "0/3: " before a guard failure's reason


def reason_line(reason: Any) -> str:
    """A guard failure's reason without its compile id, source comment and user stack."""
    text = str(reason).split("\nUser stack trace:")[0]
    return " ".join(_COMPILE_ID.sub("", text).split("#")[0].split())


def where(code: Any) -> str:
    """The function dynamo compiled; torch's own wrapper of a compiled module says so instead of naming itself."""
    name = getattr(code, "co_name", None)
    if name is None:
        return str(code)
    path = code.co_filename.replace("\\", "/")
    if "/torch/_dynamo/" in path or path.endswith("/torch/nn/modules/module.py"):
        return "a module compiled with torch.compile(module)"
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


def guard_kind(reasons: list[str]) -> str:
    """What the failing guards check: ``shape``, ``object`` (an object's identity), ``value`` (a Python number)."""
    text = " ".join(reasons).lower()
    if "size mismatch" in text or "stride mismatch" in text or ".size()" in text:
        return "shape"
    if "check_obj_id" in text or "id_match" in text or "weakref" in text:
        return "object"
    if re.search(r"== -?[\d.]+", text):
        return "value"
    return "other"


REMEDIES = {
    "shape": "the inputs' shapes change from step to step (a batch padded to its longest row compiles once per "
             "length): pad to a fixed length or a few buckets (pad_to_multiple_of), or compile with dynamic=True / "
             "torch._dynamo.mark_dynamic(tensor, dim) so one graph serves every length",
    "object": "a guard checks an object's identity and a new object comes each step (a module, closure or "
              "weakref created per step or per layer, the same compiled function called on each layer): create "
              "it once outside the loop, or compile the module itself rather than a function it is passed to",
    "value": "a Python number that changes every step (a step count, a learning rate, a length) is baked into "
             "the graph as a constant: pass it as a tensor (torch.tensor(value)) so the graph takes it as an input",
    "other": "run once with TORCH_LOGS=recompiles to see every guard that failed, and keep what it checks constant",
}


def recompiled(code: Any = None) -> tuple[str, int, list[str]] | None:
    """A function dynamo compiled again (``code``; else the one compiled again most often in this process), how
    many guard failures sent it back, and its latest distinct reasons (newest first); None where dynamo is not
    loaded or nothing recompiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    failures = getattr(utils, "guard_failures", None)
    if not failures:
        return None
    if code is not None and failures.get(code):
        reasons = failures[code]
    else:
        code, reasons = max(list(failures.items()), key=lambda item: len(item[1]))
    lines: list[str] = []
    for reason in reversed(reasons):
        line = reason_line(reason)
        if line and line not in lines:
            lines.append(line)
        if len(lines) == 5:
            break
    return where(code), len(reasons), lines
