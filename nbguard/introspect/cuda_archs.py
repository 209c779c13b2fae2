"""Which GPU architectures a CUDA build carries kernels for, and whether a GPU can run them.

A GPU runs a kernel compiled for its own architecture family: a cubin built for ``sm_XY`` runs on
compute capability X.Z with Z >= Y (an arch-specific ``sm_90a`` only on 9.0); PTX (``compute_XY``) is
compiled on the fly for any capability >= X.Y. A torch wheel built with CUDA 12.6 carries sm_50 to
sm_90 and no PTX, so on a Blackwell RTX 5090 (sm_120) every CUDA op fails with "no kernel image is
available for execution on the device" (unsloth#1856).

torch says what it was built for (``torch.cuda.get_arch_list()``); a compiled extension (bitsandbytes,
flash-attn, xformers) says it in its shared library: the ELF section ``.nv_fatbin`` holds one entry per
compiled architecture, each with a small header naming it. Reading those headers needs no GPU and
does not import (or load) the extension.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

_FATBIN_MAGIC = 0xBA55ED50
_FATBIN_PTX = 1
_INDEX = "https://download.pytorch.org/whl"
_ARCH_FLAG = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


@dataclass(frozen=True, order=True)
class KernelCode:
    cc: int  # 10 * major + minor: 90 for sm_90, 120 for sm_120
    kind: str = "sm"  # "sm": a cubin for that architecture; "compute": PTX, compiled for newer GPUs on load
    suffix: str = ""  # "a": arch-specific (runs on exactly that capability); "f": family-specific

    @property
    def label(self) -> str:
        return f"{self.kind}_{self.cc}{self.suffix}"

    def runs_on(self, capability: tuple[int, int]) -> bool:
        device = 10 * capability[0] + capability[1]
        if self.suffix == "a":
            return device == self.cc
        if self.kind == "compute":
            return device >= self.cc
        return device // 10 == self.cc // 10 and device >= self.cc


def parse_arch_flag(flag: str) -> KernelCode:
    """``"sm_90"``, ``"sm_90a"``, ``"compute_120"`` (torch.cuda.get_arch_list()'s words) as a KernelCode."""
    found = _ARCH_FLAG.match(flag.strip())
    if not found:
        raise ValueError(f"{flag!r} is not a CUDA architecture flag such as 'sm_90' or 'compute_120'")
    return KernelCode(int(found.group(2)), found.group(1), found.group(3))


def _sections(handle) -> dict[str, tuple[int, int]]:
    """{name: (offset, size)} of a 64-bit little-endian ELF file's sections."""
    head = handle.read(64)
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (table,) = struct.unpack_from("<Q", head, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", head, 0x3A)
    handle.seek(table)
    raw = handle.read(entry_size * count)
    headers = [struct.unpack_from("<IIQQQQ", raw, i * entry_size) for i in range(count)]
    handle.seek(headers[names_index][4])
    names = handle.read(headers[names_index][5])
    return {names[h[0]:names.index(b"\0", h[0])].decode(errors="replace"): (h[4], h[5]) for h in headers}


def _next_magic(handle, position: int, end: int, chunk: int = 1 << 20) -> int:
    """The offset of the next fatbin container (8-byte aligned) at or after ``position``, else ``end``."""
    magic = struct.pack("<I", _FATBIN_MAGIC)
    while position < end:
        handle.seek(position)
        data = handle.read(min(chunk, end - position) + 3)
        found = data.find(magic)
        while found != -1 and (position + found) % 8:
            found = data.find(magic, found + 1)
        if found != -1:
            return position + found
        position += chunk
    return end


def fatbin_codes(path: str | os.PathLike) -> tuple[KernelCode, ...]:
    """The architectures a CUDA shared library carries kernels for (empty: none, e.g. a CPU build)."""
    codes: set[KernelCode] = set()
    with open(path, "rb") as handle:
        offset, size = _sections(handle).get(".nv_fatbin", (0, 0))
        end, position = offset + size, offset
        while position + 16 <= end:
            handle.seek(position)
            magic, _version, header_size, body_size = struct.unpack("<IHHQ", handle.read(16))
            if magic != _FATBIN_MAGIC:  # padding between containers: jump to the next magic
                position = _next_magic(handle, position + 8, end)
                continue
            entry, body_end = position + header_size, position + header_size + body_size
            while entry + 32 <= body_end:
                handle.seek(entry)
                head = handle.read(32)
                kind, _v, entry_header, padded_payload = struct.unpack_from("<HHII", head, 0)
                (arch,) = struct.unpack_from("<I", head, 28)
                codes.add(KernelCode(arch, "compute" if kind == _FATBIN_PTX else "sm"))
                entry += entry_header + padded_payload
            position = body_end
    return tuple(sorted(codes))


@dataclass(frozen=True)
class Library:
    """One compiled CUDA library a run loads, and the architectures it carries."""
    package: str  # "bitsandbytes", "flash-attn", "xformers"
    path: str
    codes: tuple[KernelCode, ...]

    def runs_on(self, capability: tuple[int, int]) -> bool:
        return any(code.runs_on(capability) for code in self.codes)


@dataclass(frozen=True)
class CudaBuild:
    """What this environment's torch and extensions were compiled for."""
    torch_version: str
    torch_cuda: str | None  # "12.8"; None for a CPU (or ROCm) build
    torch_codes: tuple[KernelCode, ...]
    libraries: tuple[Library, ...] = ()
    missing: dict[str, str] = field(default_factory=dict)  # package -> the library it would load and lacks

    def torch_runs_on(self, capability: tuple[int, int]) -> bool:
        return any(code.runs_on(capability) for code in self.torch_codes)


def _package_dir(name: str) -> Path | None:
    """An installed package's folder, found without importing it."""
    from importlib.util import find_spec

    try:
        spec = find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _extension_file(module: str) -> Path | None:
    from importlib.util import find_spec

    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".so") else None


def bitsandbytes_library(torch_cuda: str) -> Path | None:
    """The CUDA library bitsandbytes loads for a torch built with ``torch_cuda`` (its BNB_CUDA_VERSION
    override honoured), whether or not the file exists; None when bitsandbytes is not installed."""
    folder = _package_dir("bitsandbytes")
    if folder is None:
        return None
    version = os.environ.get("BNB_CUDA_VERSION") or torch_cuda.replace(".", "")
    return folder / f"libbitsandbytes_cuda{version}.so"


def _libraries(torch_cuda: str) -> tuple[list[Library], dict[str, str]]:
    libraries, missing = [], {}
    candidates = {"flash-attn": _extension_file("flash_attn_2_cuda")}
    xformers = _package_dir("xformers")
    candidates["xformers"] = next(iter(sorted(xformers.glob("_C*.so"))), None) if xformers else None
    bnb = bitsandbytes_library(torch_cuda)
    if bnb is not None and not bnb.exists():
        missing["bitsandbytes"] = bnb.name
    candidates["bitsandbytes"] = bnb if bnb is not None and bnb.exists() else None
    for package, path in candidates.items():
        if path is None:
            continue
        try:
            libraries.append(Library(package, str(path), fatbin_codes(path)))
        except (OSError, ValueError, struct.error):  # unreadable: say nothing rather than guess
            continue
    return libraries, missing


def read_cuda_build(torch_version: str | None = None, torch_cuda: str | None = None,
                    torch_arch_list: list[str] | None = None) -> CudaBuild:
    """This environment's CUDA build: this torch's (or the torch named by the three arguments: the one a
    target machine has) and the extension libraries installed here that such a torch would load."""
    import torch

    named = (torch_version, torch_cuda, torch_arch_list)
    if any(part is not None for part in named) and any(part is None for part in named):
        raise ValueError("name the target's torch by all three of torch_version, torch_cuda and torch_arch_list "
                         "(torch.__version__, torch.version.cuda, torch.cuda.get_arch_list() there), or by none")
    version = torch.__version__ if torch_version is None else torch_version
    cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    flags = torch.cuda.get_arch_list() if torch_arch_list is None else torch_arch_list
    codes = tuple(sorted(parse_arch_flag(flag) for flag in flags))
    libraries, missing = _libraries(cuda) if cuda else ([], {})
    return CudaBuild(version, cuda, codes, tuple(libraries), missing)


def _cuda_tags_for(build: CudaBuild, capability: tuple[int, int]) -> list[str]:
    """The CUDA versions whose release builds of this torch carry this GPU's kernels, from torch's own table
    (recent releases ship it; it describes the installed release only); empty when it cannot say."""
    import torch

    table = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", None)
    if not isinstance(table, dict) or build.torch_version.split("+")[0] != torch.__version__.split("+")[0]:
        return []
    return [cuda for cuda, by_host in table.items()
            if any(KernelCode(cc).runs_on(capability) for cc in by_host.get("x86_64", ()))]


def torch_remedy(build: CudaBuild, capability: tuple[int, int]) -> str:
    """What to install so that torch carries kernels for a GPU of this capability."""
    tags = _cuda_tags_for(build, capability)
    if tags:  # the oldest such CUDA: the one the fewest drivers are too old for
        return (f"Install a build of this torch for a CUDA version that carries it ({', '.join(tags)}), e.g. "
                f"pip install torch=={build.torch_version.split('+')[0]} --index-url {_INDEX}/cu{tags[0].replace('.', '')}.")
    if capability[0] >= 10:
        return f"Install a torch built with CUDA 12.8 or newer, e.g. pip install torch --index-url {_INDEX}/cu128."
    return ("Install a torch build whose CUDA version still carries this architecture (see "
            "https://pytorch.org/get-started/previous-versions/).")
