"""The order --dist loadfile hands the files to the workers in (tests/conftest.py): longest profiled file first,
files the profile lacks before them, each file's tests in their own order."""
from __future__ import annotations

from types import SimpleNamespace

from conftest import _longest_files_first


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_profiled_files_go_longest_first_and_unprofiled_ones_before_them():
    items = _items("tests/test_a.py::one", "tests/test_b.py::one", "tests/test_c.py::one", "tests/test_a.py::two",
                   "tests/test_d.py::one", "tests/test_d.py::two", "tests/test_e.py::one")
    seconds = {"tests/test_a.py": 5.0, "tests/test_b.py": 50.0, "tests/test_e.py": 20.0}
    order = [item.nodeid for item in _longest_files_first(items, seconds)]
    assert order == ["tests/test_d.py::one", "tests/test_d.py::two", "tests/test_c.py::one",  # unprofiled, most tests first
                     "tests/test_b.py::one", "tests/test_e.py::one", "tests/test_a.py::one", "tests/test_a.py::two"]

