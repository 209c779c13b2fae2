"""Shared pytest set-up: quiet, deterministic, single-threaded torch; lane gating by marker."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub; fail fast if something tries
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def _transformers_is_450() -> bool:
    from nbguard.environment import parsed_version

    version = parsed_version("transformers")
    return version is not None and (version.major, version.minor) == (4, 50)


# The Colab lane (make test-colab) runs every notebook and these files: the surface Colab's pinned
# IPython 7, ipywidgets 7, ipykernel 6 and transformers/peft/accelerate releases change (magics, widgets,
# display and comms, nbclient kernels, the Trainer callback and the fix cells). The rest is release-
# independent logic the main lane covers; running the whole suite twice did not fit CI's 90 minutes.
COLAB_FILES = frozenset(
    f"test_{name}.py"
    for name in (
        "magics", "magics_bad_input", "widgets", "hygiene_magics", "hygiene_memory", "hygiene_nbclient",
        "hygiene_warnings", "notebook_comm", "notebook_static", "prompt_not_a_prefix", "report_nbconvert",
        "fixes", "fix_on_trainer_as_built", "watch_trainer", "watch_config", "verdict_one_cell",
        "verify_views", "export_check",
    )
)


def _profiled_slow() -> frozenset[str]:
    """The tests over 2 s in the last profiled run (tests/lanes/profile.py writes the list): make check skips them."""
    listed = Path(__file__).parent / "lanes" / "slow_tests.txt"
    return frozenset(listed.read_text().split()) if listed.exists() else frozenset()


def _file_seconds() -> dict[str, float]:
    """Seconds per test file in the last profiled run (tests/lanes/profile.py --write-files writes them)."""
    listed = Path(__file__).parent / "lanes" / "file_seconds.txt"
    if not listed.exists():
        return {}
    return {path: float(seconds) for seconds, path in (line.split() for line in listed.read_text().splitlines() if line)}


def _longest_files_first(items: list, seconds: dict[str, float] | None = None) -> list:
    """The items, their files in order of their profiled seconds, longest first (each file's tests in their own
    order). Files the profile lacks go first, most tests first: the notebooks and the multi-rank files (other
    lanes than the profiled main lane) are among the longest, and a new file is safer early than last."""
    seconds = _file_seconds() if seconds is None else seconds
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(by_file, key=lambda f: (1, -seconds[f]) if f in seconds else (0, -len(by_file[f])))
    return [item for f in order for item in by_file[f]]


def pytest_configure(config):
    """With --dist loadfile, files go to the workers in collection order, which pytest_collection_modifyitems makes
    longest first: xdist's own order (most tests first) left the few-test, long files (a browser session, the
    notebooks) for last, one worker running them while the other idled."""
    if getattr(config.option, "dist", None) == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's workers run with dist "no": tell them the files go out in their collection order."""
    node.workerinput["longest_files_first"] = getattr(node.config.option, "loadscopereorder", None) is False


def pytest_collection_modifyitems(config, items):
    """tf450 tests only run where transformers 4.50.x is installed; browser tests need Chromium;
    cuda tests need a CUDA device (none in CI: they run on a GPU machine, benchmarks/on_gpu.sh).

    In CI (CI=true) a missing Chromium is an error, not a skip: the browser test must really run.
    """
    slow_listed = _profiled_slow()
    on_450 = _transformers_is_450()
    has_chromium = shutil.which("chromium") is not None
    in_ci = os.environ.get("CI") == "true"
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.path.name in COLAB_FILES:
            item.add_marker(pytest.mark.colab)
        if item.nodeid in slow_listed:
            item.add_marker(pytest.mark.profiled_slow)
        if "tf450" in item.keywords and not on_450:
            item.add_marker(pytest.mark.skip(reason="needs transformers 4.50.x (make test-tf450)"))
        if "browser" in item.keywords and not has_chromium and not in_ci:
            item.add_marker(pytest.mark.skip(reason="Debian chromium not installed (apt-get install chromium)"))
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (bash benchmarks/on_gpu.sh on a GPU machine)"))
    if getattr(config, "workerinput", {}).get("longest_files_first"):
        items[:] = _longest_files_first(items)


@pytest.fixture(autouse=True)
def _seeded_and_clean_session():
    """Each test starts from the same RNG state, an empty nbguard session record and no watch attached:
    a test that leaves its watch on (a Trainer's, alive in a reference cycle until the collector runs)
    would otherwise leave torch's clip_grad_norm_ wrapped for the tests after it."""
    from nbguard.session import SESSION
    from nbguard.watcher.core.watch import attached_watches

    torch.manual_seed(0)
    SESSION.clear()
    yield
    for watch in attached_watches():
        watch.detach()
    SESSION.clear()
