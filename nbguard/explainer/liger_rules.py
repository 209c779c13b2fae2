"""Error signatures of Triton kernels launched where Triton cannot run them, Liger's above all."""
from __future__ import annotations

import re

from ..environment import package_version
from .match import search as match
from .rules import _diagnosis, rule

# triton/runtime/driver.py (_create_driver), Triton 3.x: raised at the first kernel launch
_NO_DRIVER = re.compile(r"(\d+) active drivers \(.*?\)\. there should only be one")
_LIGER_PATH = re.compile(r"[/\\]liger_kernel[/\\](.+?)\.py$")


def _liger_frame(exc: BaseException) -> str | None:
    """``ops/rms_norm.py:rms_norm_forward``: the innermost Liger frame of the traceback, if any."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = _LIGER_PATH.search(code.co_filename)
        if path:
            found = f"{path.group(1).replace(chr(92), '/')}.py:{code.co_name}"
        tb = tb.tb_next
    return found


@rule("triton-no-active-driver")
def triton_no_active_driver(exc):
    """Triton's "0 active drivers ([]). There should only be one.": a Triton kernel (Liger's, with use_liger_kernel=True) was launched on a machine with no GPU driver; set use_liger_kernel=False there, or run on a GPU."""
    found = match(_NO_DRIVER, str(exc))
    if not found or found.group(1) != "0":
        return None
    frame = _liger_frame(exc)
    liger = package_version("liger-kernel")
    if frame is not None:
        who = f"Liger's Triton kernel ({frame}) was launched"
    elif liger is not None:
        who = (f"A Triton kernel was launched (liger-kernel {liger} is installed: use_liger_kernel=True or "
               "apply_liger_kernel_to_* are the usual source in fine-tuning)")
    else:
        who = "A Triton kernel was launched"
    detail = (
        f"{who} on a machine where Triton found no GPU driver (CUDA or ROCm), so it cannot compile or run it. "
        "With transformers' Trainer or TRL, set use_liger_kernel=False in the TrainingArguments/SFTConfig on "
        "this machine (the model trains the same without the fused kernels, using more memory); a model patched "
        "by apply_liger_kernel_to_* must be loaded again without it. Or run on a GPU machine. Setting "
        "TRITON_INTERPRET=1 before anything imports triton runs kernels in Triton's interpreter on CPU, far "
        "slower and not for every kernel. `nbguard.audit(trainer=trainer)` predicts this before train() "
        "(rule liger-no-triton-driver)."
    )
    return _diagnosis("triton-no-active-driver", exc, "Triton kernel launched without a GPU driver"
                      + (" (Liger)" if frame or liger else ""), detail,
                      liger_frame=frame, liger_kernel=liger)
