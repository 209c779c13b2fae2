"""Rules about the attention implementation the config selects, against the hardware and the model."""
from __future__ import annotations

import functools
import inspect
import re

from ...findings import Finding
from ..context import AuditContext
from ..registry import finding, rule

_FLASH = re.compile(r"^flash_attention_(\d+)$")
# Minimum CUDA compute capability (major) per FlashAttention version, when transformers does not say.
FLASH_MIN_MAJOR = {2: 8, 3: 8, 4: 9}
# Implementations whose code applies attn_logit_softcapping, as read in transformers 5.23: eager (the
# model's own eager_attention_forward), flash (the kernel's softcap argument, integrations/flash_attention.py)
# and flex (a score_mod, integrations/flex_attention.py). What sdpa does with it is read at run time below.
SOFTCAP_IMPLEMENTATIONS = ("eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def _implementations(ctx: AuditContext) -> dict[str, str]:
    """{config path: attention implementation} for the config and its text config."""
    out = {}
    for path, cfg in zip(("config", "config.text_config"), ctx.configs):
        impl = getattr(cfg, "_attn_implementation", None)
        if isinstance(impl, str):
            out[path] = impl.removeprefix("paged|")
    return out


def flash_min_major(version: int) -> int | None:
    """The minimum compute capability (major) FlashAttention ``version`` needs, from transformers when it says."""
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX
    except Exception:
        return FLASH_MIN_MAJOR.get(version)
    entry = FLASH_ATTENTION_COMPATIBILITY_MATRIX.get(version) or {}
    return entry.get("cuda_min_major_version", FLASH_MIN_MAJOR.get(version))


@rule("flash-attention-unsupported", "error")
def flash_attention_unsupported(ctx: AuditContext) -> Finding | None:
    """FlashAttention selected for a device it cannot run on (compute capability below what it needs, or no GPU)."""
    hw = ctx.hardware
    if hw is None:  # run_audit always resolves one; a bare context may not
        return None
    for path, impl in _implementations(ctx).items():
        match = _FLASH.match(impl)
        if not match:
            continue
        version = int(match.group(1))
        need = flash_min_major(version)
        if hw.device_type == "cuda" and (need is None or hw.compute_capability is None
                                         or hw.compute_capability[0] >= need):
            continue
        cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else None
        where = (f"the {hw.display_name} has compute capability {cc}" if hw.device_type == "cuda"
                 else f"{hw.display_name} is not a CUDA GPU")
        return finding(
            "flash-attention-unsupported",
            f"{impl} cannot run on {hw.display_name}",
            f"The model is set to attn_implementation=\"{impl}\", whose kernels need an NVIDIA GPU of compute "
            f"capability {need}.0 or newer{' (Ampere)' if need == 8 else ''}, and {where}. Loading fails "
            "(\"FlashAttention only supports Ampere GPUs or newer\" from flash-attn, or transformers' own "
            "compute-capability check). Use sdpa, PyTorch's fused attention, which runs everywhere.",
            {f"{path}._attn_implementation": impl, "hardware": hw.name, "compute_capability": cc,
             "min_compute_capability": f"{need}.0" if need else None},
            fixes=["set-attn-implementation"],
        )
    return None


@functools.cache
def sdpa_raises_on_softcap() -> bool:
    """Whether this transformers' sdpa attention refuses a softcap (newer) rather than ignoring it (older)."""
    try:
        from transformers.integrations import sdpa_attention
    except Exception:
        return False
    try:
        return "softcap" in inspect.getsource(sdpa_attention.sdpa_attention_forward)
    except (OSError, TypeError):
        return False


@rule("softcap-unsupported-attention", "error")
def softcap_unsupported_attention(ctx: AuditContext) -> Finding | None:
    """attn_logit_softcapping (Gemma 2) with an attention implementation that does not apply it."""
    for path, impl in _implementations(ctx).items():
        cfg = ctx.configs[0] if path == "config" else ctx.configs[-1]
        cap = getattr(cfg, "attn_logit_softcapping", None)
        if cap is None or impl in SOFTCAP_IMPLEMENTATIONS or impl.startswith("flash_attention"):
            continue
        if impl == "sdpa" and sdpa_raises_on_softcap():
            effect = ("this transformers' sdpa attention refuses it: the first forward raises \"ValueError: `sdpa` "
                      "attention does not support `softcap`\"")
        else:
            effect = ("it is silently ignored: attention scores are not capped, so the model computes something "
                      "other than what it was trained with and its logits drift, most in long sequences")
        return finding(
            "softcap-unsupported-attention",
            f"attention softcapping ({cap}) is not applied by {impl}",
            f"The model caps its attention scores with tanh (attn_logit_softcapping={cap}), which only the eager, "
            f"flex_attention and FlashAttention implementations apply. With attn_implementation=\"{impl}\" "
            f"{effect}. Use eager attention (what current transformers picks for Gemma 2 by default; older "
            "releases warned to train it with eager).",
            {"attn_logit_softcapping": cap, f"{path}._attn_implementation": impl,
             "sdpa_raises": impl == "sdpa" and sdpa_raises_on_softcap()},
            fixes=["set-attn-implementation"],
        )
    return None
