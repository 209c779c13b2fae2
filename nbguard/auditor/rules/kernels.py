"""Model classes whose fast kernels are not importable: the silent fall-back to pure-PyTorch layers.

Gated-DeltaNet (Qwen3-Next, Qwen3.5), Mamba/Mamba2 and the hybrids built on them (Falcon-H1, Jamba, Bamba,
Zamba, NemotronH, LFM2...) run their token mixers through kernels from flash-linear-attention, causal-conv1d
or mamba-ssm. Where those packages are not importable when the modeling module is imported, transformers
keeps the model's reference PyTorch functions and says so once in a log line: the run is correct and much
slower (gated-DeltaNet without both packages: 1.22 against 0.70 s/step, transformers#48718), and the same
path is what a compiled run traces. The kernels are CUDA (Triton) kernels, so the rule speaks only for a GPU
target; the decision is read as transformers made it (:mod:`nbguard.introspect.fast_kernels`).
"""
from __future__ import annotations

from ...findings import Finding
from ...introspect.fast_kernels import kernel_fallbacks
from ..context import AuditContext
from ..registry import finding, rule


@rule("fast-kernels-missing", "warning")
def fast_kernels_missing(ctx: AuditContext) -> Finding | None:
    """A layer class of the model (gated DeltaNet, Mamba, Mamba2...) runs its reference PyTorch path because flash-linear-attention, causal-conv1d or mamba-ssm is not importable: correct, and much slower on a GPU."""
    hw, model = ctx.hardware, ctx.model
    if model is None or hw is None or hw.device_type != "cuda":
        return None  # the kernels are CUDA kernels: on a CPU or MPS target the PyTorch path is the only one
    if getattr(model, "_use_kernels", False):
        return None  # hub kernels (use_kernels=True) replace these functions from the Hub
    fallbacks, layers = kernel_fallbacks(model)
    if not fallbacks:
        return None
    by_package: dict[str, list[str]] = {}
    for fallback in fallbacks:
        by_package.setdefault(fallback.distribution, []).append(fallback.function)
    install = sorted(by_package)
    what = "; ".join(f"{dist}: {', '.join(names)}" for dist, names in sorted(by_package.items()))
    where = ", ".join(layers) if layers else type(model).__name__
    return finding(
        "fast-kernels-missing",
        f"{where} run{'s' if len(layers) == 1 else ''} pure-PyTorch fallbacks: {', '.join(install)} not installed",
        f"transformers imported this model's layers ({where}) without {' and '.join(install)}, so they run their "
        f"reference PyTorch functions in place of the fused kernels ({what}). The results are correct and every "
        f"step is slower on {hw.display_name}: a gated-DeltaNet model without flash-linear-attention and "
        "causal-conv1d measured 1.22 against 0.70 s/step (transformers#48718), and a long sequence runs its "
        "recurrence token by token. transformers chooses once, when the modeling module is imported, and says it "
        f"only in one log line. Install them (pip install {' '.join(install)}, which need a CUDA build of torch), "
        "then restart the kernel and load the model again.",
        {"fallbacks": [{"function": f.function, "package": f.package, "distribution": f.distribution,
                        "module": f.module} for f in fallbacks],
         "layers": layers, "install": install, "hardware": hw.name},
    )
