"""Reading a pickle without running it.

``training_args.bin`` in a Trainer checkpoint is ``torch.save(args)``: a pickle of arbitrary objects. Unpickling
it the ordinary way runs whatever callables it names (``os.system`` included), and transformers itself never
loads it without ``weights_only=True``, so nbguard must not either. Here every global the pickle names becomes an
inert stand-in (:class:`InertObject`) that records how it was called and the state it was given; nothing the
pickle names is imported or called. What the audit needs (a TrainingArguments' fields) is read off the stand-in,
and the names the pickle would have called are kept, so the audit can say when a checkpoint is a trap.
"""
from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import Any

from .user_files import read_bytes

# torch.save writes a few KB of arguments; anything far larger is not a TrainingArguments.
MAX_PICKLE_BYTES = 4 * 1024 * 1024
# The packages whose classes a saved TrainingArguments (or a subclass: TRL's configs) is built from, and the
# builtins pickle itself reconstructs with; a global from anywhere else is a callable no saved arguments need.
EXPECTED_PACKAGES = {"transformers", "trl", "peft", "accelerate", "enum", "copyreg", "collections", "datetime",
                     "pathlib", "_codecs"}
EXPECTED_TORCH = {"torch.device", "torch.dtype", "torch.float16", "torch.bfloat16", "torch.float32", "torch.float64"}
SAFE_BUILTINS = {"set", "frozenset", "list", "dict", "tuple", "bytearray", "slice", "complex", "object", "bool", "int",
                 "float", "str", "bytes", "range"}


class InertObject:
    """Stands for an object (or callable) a pickle names: holds the name, the call's arguments and its state."""

    inert_name = "?"
    inert_args: tuple[Any, ...]
    inert_state: Any
    inert_items: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        obj = object.__new__(cls)
        obj.inert_args = args
        obj.inert_state = None
        obj.inert_items = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # pickle's INST/REDUCE call the class: record only
        pass

    def __setstate__(self, state: Any) -> None:
        self.inert_state = state

    # list and dict subclasses get their items through these (APPENDS, SETITEMS)
    def append(self, item: Any) -> None:
        self.inert_items.append(item)

    def extend(self, items: Any) -> None:
        self.inert_items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.inert_items.append((key, value))

    def fields(self) -> dict[str, Any]:
        """The attributes the object would have had: its state dict (or a (state, slots) pair's parts)."""
        state = self.inert_state
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            return merged
        return dict(state) if isinstance(state, dict) else {}

    def __repr__(self) -> str:
        return f"<inert {self.inert_name}>"


@dataclass
class InertPickle:
    """What a pickle holds, read without running it."""

    value: Any
    globals_named: list[str] = field(default_factory=list)  # every "module.name" the pickle refers to

    @property
    def unexpected_callables(self) -> list[str]:
        """Names a real unpickling would import and may call that no saved TrainingArguments needs."""
        out = []
        for name in self.globals_named:
            module, _, attr = name.rpartition(".")
            if module == "builtins":
                expected = attr in SAFE_BUILTINS
            else:
                expected = name in EXPECTED_TORCH or module.split(".")[0] in EXPECTED_PACKAGES
            if not expected:
                out.append(name)
        return out


class _InertUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose every global is an inert stand-in: no import, no call of anything the data names."""

    def __init__(self, data: io.BytesIO) -> None:
        super().__init__(data)
        self.named: list[str] = []
        self._classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> type:  # never super(): that imports and returns the real one
        qualified = f"{module}.{name}"
        if qualified not in self._classes:
            self.named.append(qualified)
            self._classes[qualified] = type(name, (InertObject,), {"inert_name": qualified})
        return self._classes[qualified]

    def persistent_load(self, pid: Any) -> Any:  # torch's tensor storages: not read
        return InertObject()


def _unpickle(data: bytes) -> InertPickle:
    unpickler = _InertUnpickler(io.BytesIO(data))
    value = unpickler.load()
    return InertPickle(value=value, globals_named=unpickler.named)


def read_torch_save(path: str, max_bytes: int = MAX_PICKLE_BYTES) -> InertPickle:
    """The object ``torch.save`` wrote to ``path``, as inert stand-ins. Reads the zip format's ``data.pkl`` and
    the legacy format (a magic number, a protocol, system info, then the object). Raises UserFileError (a
    ValueError) on a special file or one over ``max_bytes``, ValueError on one of neither format, pickle's own
    errors on malformed data."""
    raw = read_bytes(path, limit=max_bytes)  # refuses FIFOs and devices, and anything over max_bytes
    if zipfile.is_zipfile(io.BytesIO(raw)):
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = [i for i in archive.infolist() if i.filename.endswith("data.pkl")]
            if not entries:
                raise ValueError(f"{path}: a zip without data.pkl, not a torch.save file")
            if entries[0].file_size > max_bytes:
                raise ValueError(f"{path}: its data.pkl unpacks to over {max_bytes} bytes")
            return _unpickle(archive.read(entries[0]))
    stream = io.BytesIO(raw)
    header = _InertUnpickler(stream)
    for _ in range(3):  # magic number, protocol version, sys info
        header.load()
    rest = _InertUnpickler(stream)
    value = rest.load()
    return InertPickle(value=value, globals_named=header.named + rest.named)


def plain(value: Any, depth: int = 0) -> Any:
    """A stand-in's readable value: an enum member's value, a dataclass's fields; primitives as they are."""
    if depth > 8:
        return None
    if isinstance(value, InertObject):
        if value.inert_state is None and len(value.inert_args) == 1:
            return plain(value.inert_args[0], depth + 1)  # an Enum member: Cls(value)
        return {k: plain(v, depth + 1) for k, v in value.fields().items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value[:64]]
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in list(value.items())[:256]}
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
