"""A GPU that the installed torch or a CUDA extension the run loads has no kernels for.

On a Blackwell GPU (B200 sm_100, RTX 50xx sm_120) a torch built with CUDA 12.6 warns "sm_120 is not
compatible with the current PyTorch installation" and every CUDA op then fails with "no kernel image
is available for execution on the device"; bitsandbytes, flash-attn and xformers each carry their own
kernels and fail the same way on their first call (unsloth#1856, #3220). The other way round, torch
builds for CUDA 12.9 and newer dropped sm_70, so a V100 gets no kernels from them. The rule compares
the GPU's compute capability with what each build carries (introspect/cuda_archs.py). It judges the
builds installed here, so it says nothing where this torch has no CUDA (a CPU build cannot tell what
the target machine will install).
"""
from __future__ import annotations

from ...introspect.cuda_archs import CudaBuild, torch_remedy
from ..registry import finding, rule
from .attention import _FLASH, _implementations
from .quantization import _bnb_optimizer, _optimizer_bits


def _labels(codes) -> str:
    return " ".join(code.label for code in codes) or "none"


def _packages_in_use(ctx) -> set[str]:
    """The CUDA extensions this run will load: bitsandbytes for 4/8-bit layers or a bnb optimizer,
    flash-attn for a FlashAttention 2 model, xformers under Unsloth."""
    uses = set()
    if ctx.quantization.any or _bnb_optimizer(ctx) is not None or _optimizer_bits(ctx)[0] is not None:
        uses.add("bitsandbytes")
    if any(_FLASH.match(impl) for impl in _implementations(ctx).values()):
        uses.add("flash-attn")
    if ctx.unsloth.any:
        uses.add("xformers")
    return uses


@rule("cuda-arch-not-built", "error")
def cuda_arch_not_built(ctx):
    """The GPU's architecture is missing from the installed torch or a CUDA extension the run loads: every op on it fails with "no kernel image is available"."""
    hw = ctx.hardware
    if hw is None or hw.device_type != "cuda" or hw.compute_capability is None:
        return None
    build: CudaBuild = ctx.cuda_build
    if build.torch_cuda is None:
        return None
    cc = hw.compute_capability
    sm = f"sm_{cc[0]}{cc[1]}"
    problems, evidence = [], {"gpu": hw.display_name, "compute_capability": f"{cc[0]}.{cc[1]}",
                              "torch": build.torch_version, "torch_cuda": build.torch_cuda}
    if build.torch_codes and not build.torch_runs_on(cc):
        evidence["torch_arch_list"] = [code.label for code in build.torch_codes]
        problems.append(f"torch {build.torch_version} carries kernels for {_labels(build.torch_codes)} and none for "
                        f"{sm}: it warns \"{sm} is not compatible with the current PyTorch installation\" and every "
                        f"CUDA op fails with \"no kernel image is available for execution on the device\". "
                        + torch_remedy(build, cc))
    uses = _packages_in_use(ctx)
    for library in build.libraries:
        if library.package in uses and library.codes and not library.runs_on(cc):
            evidence[f"{library.package}_archs"] = [code.label for code in library.codes]
            evidence[f"{library.package}_library"] = library.path
            problems.append(f"{library.package}'s {library.path.rsplit('/', 1)[-1]} carries kernels for "
                            f"{_labels(library.codes)} and none for {sm}: its first call fails the same way. "
                            f"Install a {library.package} release built for {sm}.")
    if "bitsandbytes" in build.missing and "bitsandbytes" in uses:
        evidence["bitsandbytes_missing_library"] = build.missing["bitsandbytes"]
        problems.append(f"bitsandbytes has no {build.missing['bitsandbytes']} for this torch's CUDA "
                        f"{build.torch_cuda}: it loads without GPU support and 4-bit layers and 8-bit optimizers "
                        "fail. Upgrade bitsandbytes (0.45.3 added CUDA 12.8 builds for Blackwell).")
    if not problems:
        return None
    return finding(
        "cuda-arch-not-built", f"no kernels for the {hw.display_name} ({sm}) in {len(problems)} installed build(s)",
        " ".join(problems), evidence)

