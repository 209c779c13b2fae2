"""Error signatures of ``torch.compile``: the recompile limit hit (a compile storm that became an error).

Dynamo compiles a function again each time one of its guards fails (a new shape, a new value of a Python
number, a new object where it checked an identity) and stops at ``torch._dynamo.config.recompile_limit``
(8; ``cache_size_limit`` before torch 2.6). Past it, dynamo runs the function uncompiled, or, where
``fail_on_recompile_limit_hit`` is set (Unsloth sets it), raises ``FailOnRecompileLimitHit``: at step 0 when
one compiled function is called on each layer with something the guards see differently per layer
(unsloth#6825). ``error_on_recompile`` turns the first recompile into a ``RecompileError``.
"""
from __future__ import annotations

import re
import sys
from types import CodeType

from ..introspect.dynamo_guards import REMEDIES, guard_kind, reason_line, recompiled
from .match import normalised
from .rules import _diagnosis, rule

_LIMIT_HIT = re.compile(r"hard failure due to fail_on_recompile_limit_hit|recompile limit exceeded|"
                        r"hit config\.(?:recompile_limit|cache_size_limit)|cache_size_limit reached")
_LIMIT_VALUE = re.compile(r"\(currently set to (\d+)\)|hit config\.\w+ \((\d+)\)")
_LIMIT_TYPE = re.compile(r"limit type: (\w+)")
_RECOMPILE_ERROR = re.compile(r"recompiling function (\w+) in (\S+) triggered by the following guard failure")
SUGGESTED_LIMIT = 64  # room for one graph per layer of a usual model, or a handful of shape buckets


def _code_compiled(exc: BaseException):
    """The code object dynamo was compiling when it raised: ``_compile``'s ``code`` in convert_frame.py, on the
    traceback of ``exc`` or of the errors it was raised from (FailOnRecompileLimitHit is raised from dynamo's
    Unsupported). Only the code object is kept, never a frame."""
    link: BaseException | None = exc
    for _ in range(4):
        if link is None:
            return None
        tb = link.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.replace("\\", "/").endswith("/torch/_dynamo/convert_frame.py"):
                code = frame.f_locals.get("code")
                if isinstance(code, CodeType):
                    return code
            tb = tb.tb_next
        link = link.__cause__ or link.__context__
    return None


def _configured_limit() -> int | None:
    config = sys.modules.get("torch._dynamo.config")
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


@rule("torch-compile-recompile-limit")
def recompile_limit(exc):
    """torch.compile hit its recompile limit (FailOnRecompileLimitHit, "Dynamo recompile limit exceeded", RecompileError): a function compiled again for every new shape, Python number or object its guards check."""
    text = normalised(str(exc))
    name = type(exc).__name__
    hit = name == "FailOnRecompileLimitHit" or _LIMIT_HIT.search(text) is not None
    error = name == "RecompileError" and _RECOMPILE_ERROR.search(text) is not None
    if not hit and not error:
        return None
    value = _LIMIT_VALUE.search(text)
    limit = int(value.group(1) or value.group(2)) if value else _configured_limit()
    typed = _LIMIT_TYPE.search(text)
    limit_type = typed.group(1) if typed else "recompile_limit"
    seen = recompiled(_code_compiled(exc))
    function, failures, reasons = seen if seen is not None else (None, 0, [])
    if error and not reasons:
        reasons = [reason_line(line) for line in str(exc).splitlines()[1:] if line.strip()][:5]
    kind = guard_kind(reasons)
    suggested = max(SUGGESTED_LIMIT, 2 * (limit or 8))
    what = (f"{function} was compiled again {failures} time(s) in this process; the guards that failed, newest "
            f"first: {'; '.join(reasons[:3])}. " if function else "")
    if error:
        head = ("torch._dynamo.config.error_on_recompile is set, so the first recompile raised. ")
    else:
        head = (f"torch.compile compiles a function again each time a guard fails and stops at "
                f"torch._dynamo.config.{limit_type} ({limit if limit is not None else 'its limit'}); this run hit "
                "it, and with fail_on_recompile_limit_hit set (Unsloth sets it) that is this error rather than a "
                "silent fall-back to uncompiled (eager) code, which would only have been slower. ")
    detail = (
        head + what + f"Why: {REMEDIES[kind]}. Where the values the guards see are a small fixed set (one per "
        f"layer: a layer index, a sliding window, an object held per layer, which is how it fails at step 0 "
        f"(unsloth#6825)), raise the limit to cover them: torch._dynamo.config.recompile_limit = {suggested} "
        "(cache_size_limit on torch < 2.6). Where they change every step (lengths, step counts), a higher limit only "
        "delays the same error: remove the cause. TORCH_LOGS=recompiles prints every recompile's reason."
    )
    title = (f"torch.compile hit its recompile limit ({limit})" if not error else
             "torch.compile refused to recompile (error_on_recompile)")
    return _diagnosis("torch-compile-recompile-limit", exc, title, detail, limit=limit, limit_type=limit_type,
                      function=function, guard_failures=failures, reasons=reasons, guard_kind=kind,
                      suggested_recompile_limit=suggested,
                      fail_on_recompile_limit_hit=name == "FailOnRecompileLimitHit" or None)
