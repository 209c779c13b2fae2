"""Reading files from a user's folder (a checkpoint, an exported adapter) without trusting them.

A downloaded or half-written folder can hold anything under the expected name: a FIFO (``open`` waits
for a writer for ever), a device, a 2**62-byte safetensors header length, JSON nested 100,000 deep, a list
where an object belongs. Every reader here bounds what it reads, opens non-blocking and refuses anything
that is not a regular file, bounds JSON nesting before parsing, and raises one exception,
:class:`UserFileError`, whose text names the file and what was wrong: callers turn it into a finding (or
the ``unreadable`` evidence), never let it escape.
"""
from __future__ import annotations

import json
import os
import stat
import struct
from typing import Any

from ..document.codec import json_depth

# bounds: far above what transformers/PEFT write (an index of a 400-shard model is ~2 MB; a long run's
# trainer_state.json a few MB), far below what would stall an audit
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header
MAX_TENSOR_DIMS = 16


class UserFileError(ValueError):
    """A file in a user's folder that cannot be read as what it should be; ``str()`` names file and reason."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = os.fspath(path), reason
        super().__init__(f"{os.path.basename(self.path)}: {reason}")


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str | None:
    """What a non-regular file is, None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def special_kind(path: str) -> str | None:
    """None for a regular file (or one that does not exist); else what it is ("a FIFO (named pipe)", ...),
    from ``os.stat`` (which opens nothing). For folders a library will read: refuse to hand it over."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _kind(st.st_mode)


def _open(path: str) -> int:
    """A descriptor on a regular file: opened non-blocking (a FIFO opens at once, without a writer) and
    checked with fstat on the descriptor itself, so a file swapped between a check and the open is caught too."""
    kind = special_kind(path)
    if kind is not None:
        raise UserFileError(path, f"is {kind}, not a regular file: nbguard does not read it")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise UserFileError(path, f"cannot be opened ({type(exc).__name__}: {exc.strerror or exc})") from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
    except OSError:
        kind = "not a regular file"
    if kind is not None:
        os.close(fd)
        raise UserFileError(path, f"is {kind}, not a regular file: nbguard does not read it")
    return fd


def _read_fd(fd: int, size: int, path: str) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    if len(data) < size:
        raise UserFileError(path, f"ends after {len(data)} of the {size} bytes expected (truncated)")
    return data


def read_bytes(path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole file, refused (``UserFileError``) when it is over ``limit`` bytes or not a regular file."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UserFileError(path, f"is {size} bytes, over nbguard's limit of {limit} bytes for this file")
        data = os.read(fd, limit + 1) if size == 0 else _read_fd(fd, size, path)
        if len(data) > limit:
            raise UserFileError(path, f"is over nbguard's limit of {limit} bytes for this file")
        return data
    finally:
        os.close(fd)


def parse_json(data: bytes, path: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON text as Python data; nesting over ``max_depth`` or any parse error raise ``UserFileError``."""
    depth = json_depth(data)
    if depth > max_depth:
        raise UserFileError(path, f"is JSON nested {depth} deep, over nbguard's limit of {max_depth}")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserFileError(path, f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise UserFileError(path, f"is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def read_json(path: str, *, limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON file, bounded in bytes and nesting."""
    return parse_json(read_bytes(path, limit), path, max_depth)


def read_json_object(path: str, *, limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A JSON file that must hold an object (a config, an index, a trainer state)."""
    value = read_json(path, limit=limit, max_depth=max_depth)
    if not isinstance(value, dict):
        raise UserFileError(path, f"holds {_type(value)} where a JSON object belongs")
    return value


def field_of(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], path: str, default: Any = None) -> Any:
    """``doc[key]`` when it has the type expected, ``default`` when absent; another type raises ``UserFileError``."""
    if key not in doc or doc[key] is None:
        return default
    value = doc[key]
    names = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, names) or (isinstance(value, bool) and bool not in names):
        raise UserFileError(path, f'"{key}" holds {_type(value)} where '
                                  f'{" or ".join(_type(t()) for t in names)} belongs')
    return value


def str_map(doc: dict[str, Any], key: str, path: str) -> dict[str, str]:
    """``doc[key]`` as a mapping of strings to strings (an index's ``weight_map``)."""
    value = field_of(doc, key, dict, path, default={})
    bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise UserFileError(path, f'"{key}" maps {bad!r} to {_type(value[bad])} where a file name belongs')
    return value


def safetensors_header(path: str, *, limit: int = MAX_SAFETENSORS_HEADER) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file declares (name -> {"dtype", "shape", "data_offsets"}), read from its header
    alone: the 8-byte length is bounded (by ``limit`` and the file's size) before anything else is read, every
    entry's shape and offsets are checked against the file. The weights are not read."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise UserFileError(path, f"is {size} bytes: too short for a safetensors header")
        (length,) = struct.unpack("<Q", _read_fd(fd, 8, path))
        if length > limit:
            raise UserFileError(path, f"declares a safetensors header of {length} bytes, over the limit of {limit}")
        if length > size - 8:
            raise UserFileError(path, f"declares a safetensors header of {length} bytes in a file of {size} bytes "
                                      "(truncated or not safetensors)")
        header = parse_json(_read_fd(fd, length, path), path)
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise UserFileError(path, f"has a safetensors header holding {_type(header)} where an object belongs")
    data = size - 8 - length
    tensors: dict[str, dict[str, Any]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS \
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise UserFileError(path, f"declares tensor {name!r} with no valid shape ({str(shape)[:80]})")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise UserFileError(path, f"declares tensor {name!r} at bytes {str(offsets)[:80]}, outside the "
                                      f"{data} bytes of data the file holds (truncated or corrupt)")
        tensors[name] = entry
    return tensors
