# Everything a fresh machine (Python 3.11, no GPU) needs, from two commands:
#   make demo   run the quickstart notebook headless; executed copies and reports land in build/
#   make test   every test lane: the pinned releases (constraints/main.txt; the docs build and the wheel check
#               included), its multi-rank tests with both cores busy, the Colab profile, transformers 4.50,
#               the real axolotl, LLaMA-Factory, litgpt and torchtune
# Also: make check (lint, types and the fast tests, the inner loop), make docs (the site, strictly, into build/site/), make wheel (dist/, with the prebuilt Lab extension),
# make test-newest (the newest releases, unpinned: reports drift, gates nothing), make lock (re-pin main),
# make test-loaded RUNS=3 (the multi-rank tests with both cores busy, three times in a row).
SHELL := /bin/bash
PYTHON ?= python3
# Every lane's versions live in the repository: main is a lock of a known-good set, colab and tf450 the
# profiles of those runtimes (a fresh clone needs nothing beside it).
CONSTRAINTS := constraints
# The CPU build of torch lies on this machine's disk; install it before anything that depends on
# torch, or pip pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
PIP_QUIET := -q --disable-pip-version-check
# Every lane's venv is made and filled by uv (pinned, bootstrapped once with pip into .venv-tools/): it
# downloads in parallel, so the main venv installs in about 80 s where pip took 974 s on a fresh machine
# (the 90-minute CI budget holds three lanes). pip's find-links (where the CPU torch lies) carry over.
UV_TOOL := .venv-tools
UV := $(UV_TOOL)/bin/uv
UV_VERSION := uv==0.13.9
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
export UV_FIND_LINKS := $(FIND_LINKS)
export UV_INDEX_STRATEGY := unsafe-best-match
UV_INSTALL = $(UV) pip install -q
# Two cores: one intra-op thread per test process keeps timings steady.
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

VENV := .venv
# make demo's own venv: nbguard with only what the quickstart needs (no test, docs, browser, quant or tracker
# extras), so a first run installs a fraction of the development venv.
DEMO_VENV := .venv-demo
COLAB_VENV := .venv-colab
TF450_VENV := .venv-tf450
# torchao has a venv of its own: transformers imports it at every model import wherever it is installed, which
# changes how every other lane loads models and prints its "Failed to load" lines into every kernel's output.
QUANT_VENV := .venv-quant
NEWEST_VENV := .venv-newest
# axolotl and LLaMA-Factory build the transformers Trainer themselves and each pins its own transformers (5.16 and
# 5.6): a venv each, where nbguard's plugin and callback are tested on the real packages (tests/test_axolotl_entry.py,
# tests/test_llamafactory_entry.py).
AXOLOTL_VENV := .venv-axolotl
LLAMAFACTORY_VENV := .venv-llamafactory
# litgpt (a Fabric loop) and torchtune (a recipe class) run their own loops: a venv each, where the watch is
# tested on the real packages (tests/test_litgpt_entry.py, tests/test_torchtune_entry.py).
LITGPT_VENV := .venv-litgpt
TORCHTUNE_VENV := .venv-torchtune
EXTRAS := hf,test,browser,trackers,docs,frameworks
# How many times test-loaded runs the multi-rank tests under load (three in a row before a stop).
RUNS ?= 1
# pytest workers per lane (pytest-xdist; 0: one process). A test file stays on one worker.
WORKERS ?= 2
PYTEST_PARALLEL = -n $(WORKERS) --dist loadfile

.PHONY: demo check docs wheel test test-main test-main-parallel test-main-serial test-loaded test-labextension test-colab test-tf450 test-quant test-newest lock \
	test-axolotl test-llamafactory test-litgpt test-torchtune test-serial-then-labextension test-frameworks \
	install clean lint

install: $(VENV)/.stamp

$(UV):
	$(PYTHON) -m venv $(UV_TOOL)
	$(UV_TOOL)/bin/pip install $(PIP_QUIET) $(UV_VERSION)

# A lane's venv (with pip in it: some tests and tests/lanes/newest.py call it), torch's CPU build first.
define new_venv
	rm -rf $(1)
	$(UV) venv -q --seed -p $(PYTHON) $(1)
	$(UV_INSTALL) -p $(1) $(TORCH)
endef

# The main lane: the lock in constraints/main.txt, so a clean clone installs what passed here; the newest
# releases are test-newest's business.
$(VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/main.txt | $(UV)
	$(call new_venv,$(VENV))
	# the lab extension is built through hatch-jupyter-builder: needs node and npm on PATH.
	$(UV_INSTALL) -p $(VENV) -e ".[$(EXTRAS)]" -c $(CONSTRAINTS)/main.txt
	touch $@

# The Colab lane: the versions a Colab GPU runtime ships, held by a constraints file.
$(COLAB_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/colab.txt | $(UV)
	$(call new_venv,$(COLAB_VENV))
	$(UV_INSTALL) -p $(COLAB_VENV) -r $(CONSTRAINTS)/colab.txt
	$(UV_INSTALL) -p $(COLAB_VENV) -e ".[hf,test]" -c $(CONSTRAINTS)/colab.txt
	touch $@

# The transformers 4.50 lane, where Gemma 3 eval under bf16 really crashes on HybridCache.
$(TF450_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/transformers-4.50.txt | $(UV)
	$(call new_venv,$(TF450_VENV))
	$(UV_INSTALL) -p $(TF450_VENV) -r $(CONSTRAINTS)/transformers-4.50.txt
	$(UV_INSTALL) -p $(TF450_VENV) -e ".[test]" -c $(CONSTRAINTS)/transformers-4.50.txt
	touch $@

# The quantised dry pass on real torchao layers (tests marked quant), on the main lock.
$(QUANT_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/main.txt | $(UV)
	$(call new_venv,$(QUANT_VENV))
	$(UV_INSTALL) -p $(QUANT_VENV) -e ".[hf,quant]" pytest pytest-timeout -c $(CONSTRAINTS)/main.txt
	touch $@

# axolotl as `pip install axolotl` resolves it, held by its lock.
$(AXOLOTL_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/axolotl.txt | $(UV)
	$(call new_venv,$(AXOLOTL_VENV))
	$(UV_INSTALL) -p $(AXOLOTL_VENV) -e ".[hf]" axolotl pytest pytest-timeout -c $(CONSTRAINTS)/axolotl.txt
	touch $@

# LLaMA-Factory: its lock installed as it stands (--no-deps), without torchvision, and torchaudio without its
# compiled extension: on PyPI both are built against CUDA torch and fail to load beside the CPU torch
# (constraints/llamafactory.txt says why each is safe to leave out).
$(LLAMAFACTORY_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/llamafactory.txt | $(UV)
	$(call new_venv,$(LLAMAFACTORY_VENV))
	$(UV_INSTALL) -p $(LLAMAFACTORY_VENV) --no-deps -r $(CONSTRAINTS)/llamafactory.txt -e .
	rm -f $(LLAMAFACTORY_VENV)/lib/python*/site-packages/torchaudio/lib/*.so
	touch $@

$(LITGPT_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/litgpt.txt | $(UV)
	$(call new_venv,$(LITGPT_VENV))
	$(UV_INSTALL) -p $(LITGPT_VENV) -e ".[hf,test]" litgpt -c $(CONSTRAINTS)/litgpt.txt
	touch $@

# torchtune 0.6.1 imports torchao without requiring it: named here, held at 0.13.0 by its lock (0.18 lacks nf4tensor).
$(TORCHTUNE_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/torchtune.txt | $(UV)
	$(call new_venv,$(TORCHTUNE_VENV))
	$(UV_INSTALL) -p $(TORCHTUNE_VENV) -e ".[hf,test]" torchtune torchao -c $(CONSTRAINTS)/torchtune.txt
	touch $@

# The newest releases, unpinned, rebuilt each time: what a user who pip-installs today gets.
$(NEWEST_VENV)/.stamp: pyproject.toml | $(UV)
	$(call new_venv,$(NEWEST_VENV))
	$(UV_INSTALL) -p $(NEWEST_VENV) -e ".[$(EXTRAS),quant]" -c $(CONSTRAINTS)/torch.txt
	touch $@

$(DEMO_VENV)/.stamp: pyproject.toml $(CONSTRAINTS)/main.txt | $(UV)
	$(call new_venv,$(DEMO_VENV))
	$(UV_INSTALL) -p $(DEMO_VENV) -e ".[hf,demo]" -c $(CONSTRAINTS)/main.txt
	touch $@

demo: $(DEMO_VENV)/.stamp
	$(DEMO_VENV)/bin/python notebooks/run.py --out build/demo notebooks/00_quickstart.ipynb

# The site, built strictly (a warning fails it) and offline; the executed quickstart is one of its pages.
# tests/test_docs.py runs the same build in test-main, beside the check that no registry entry lacks its page.
docs: demo
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

# The wheel Colab and every non-checkout user installs: the Lab extension is built here (node and npm on
# this machine) and shipped prebuilt, so installing it needs no node (tests/test_wheel.py checks that).
wheel: $(VENV)/.stamp
	$(VENV)/bin/pip wheel . --no-deps $(PIP_QUIET) -w dist/

# make test packs the lanes onto the two cores: whatever leaves a core idle runs beside something else.
# 1. mypy (one core) while the other venvs install (network and disk), and, on the core mypy leaves idle once
#    their venvs are in, the transformers 4.50 and quantised lanes (one process each);
# 2. the main lane on both cores;
# 3. the one-process steps as two chains side by side, each ~170 s: its serial step (the wheel build) then the
#    Lab extension's tests (never beside each other: both run npm in labextension/), and axolotl, LLaMA-Factory,
#    litgpt and torchtune one after the other (paired step by step they left a core idle ~130 s of 305);
# 4. the loaded multi-rank run beside the Colab lane: each is the other's load, and the burners, at the
#    lowest priority, fill whatever core the two leave idle.
# One after the other these took 66 minutes of CI's 90 on a fresh clone (3956 s of make test); see
# docs/contributing.md for the figures since. Lines of the side-by-side steps interleave (each carries its
# elapsed seconds in CI): a run cut off still shows every lane's progress.
test: $(VENV)/.stamp
	$(MAKE) --no-print-directory -j4 lint $(COLAB_VENV)/.stamp $(TF450_VENV)/.stamp $(QUANT_VENV)/.stamp \
		$(AXOLOTL_VENV)/.stamp $(LLAMAFACTORY_VENV)/.stamp $(LITGPT_VENV)/.stamp $(TORCHTUNE_VENV)/.stamp \
		test-tf450 test-quant
	$(MAKE) --no-print-directory test-main-parallel
	$(MAKE) --no-print-directory -j2 test-serial-then-labextension test-frameworks
	$(MAKE) --no-print-directory -j2 BURNER_NICE=19 test-loaded test-colab

# make test's two one-process chains (step 3 above).
test-serial-then-labextension:
	$(MAKE) --no-print-directory test-main-serial
	$(MAKE) --no-print-directory test-labextension

test-frameworks:
	$(MAKE) --no-print-directory test-axolotl
	$(MAKE) --no-print-directory test-llamafactory
	$(MAKE) --no-print-directory test-litgpt
	$(MAKE) --no-print-directory test-torchtune

# Every test of the main lane but the multi-rank ones (test-loaded runs those) and the notebooks (test-colab
# runs every one, on the releases notebook users have; executing them twice did not fit CI's 90 minutes),
# on every core; after them, in one process, the tests that rewrite files others read (isolated: the wheel
# build).
MAIN_TESTS := not tf450 and not multirank and not notebooks and not quant and not axolotl and not llamafactory \
	and not litgpt and not torchtune
test-main: lint
	$(MAKE) --no-print-directory test-main-parallel
	$(MAKE) --no-print-directory test-main-serial

test-main-parallel: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest $(PYTEST_PARALLEL) -m "$(MAIN_TESTS) and not isolated"

test-main-serial: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest -m "$(MAIN_TESTS) and isolated"

# The inner loop, a few minutes: ruff, mypy and the fast tests of the main lane (those the last profile found
# under 2 s: tests/lanes/slow_tests.txt, written by tests/lanes/profile.py from a --junitxml run). make test
# stays the gate.
check: lint
	$(VENV)/bin/python -m pytest $(PYTEST_PARALLEL) -q -m "$(MAIN_TESTS) and not isolated and not browser and not profiled_slow"

# Multi-rank verdicts must not depend on timing: two burners keep both cores busy while the multi-rank
# tests (and notebook 07) run RUNS times in a row; the burners stop however the run ends. A gate: make test
# runs it once, beside the Colab lane (below), and three runs in a row come before each stop (see
# docs/contributing.md). BURNER_NICE=19 makes the burners fill only what other work leaves idle.
# The tests go to two workers one by one (--dist load: a two-rank launch leaves much of a core idle while
# its ranks wait on each other, and test_ddp_watch.py alone holds most of them).
BURNER_NICE ?= 0
LOADED_WORKERS ?= 2
test-loaded: $(VENV)/.stamp
	$(VENV)/bin/python tests/lanes/loaded.py --runs $(RUNS) --nice $(BURNER_NICE) -- \
		$(VENV)/bin/python -m pytest -n $(LOADED_WORKERS) --dist load -m "multirank and not tf450" -q

# Drift, not a gate: the newest releases against the suite. The summary (what changed against the lock,
# what failed) lands in build/newest/summary.txt and is printed; the target exits 0 either way.
test-newest:
	rm -f $(NEWEST_VENV)/.stamp
	$(MAKE) $(NEWEST_VENV)/.stamp
	$(NEWEST_VENV)/bin/python tests/lanes/newest.py --lock $(CONSTRAINTS)/main.txt --out build/newest -- \
		$(NEWEST_VENV)/bin/python -m pytest $(PYTEST_PARALLEL) -m "not tf450 and not browser" -q -p no:cacheprovider

# Re-pin the main lane to the newest set (after test-newest came back clean, or its failures were fixed).
lock: $(NEWEST_VENV)/.stamp
	$(NEWEST_VENV)/bin/python tests/lanes/newest.py --write-lock $(CONSTRAINTS)/main.txt

# ruff (lint) and mypy (types), configured in pyproject.toml; both must be clean.
lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# TypeScript unit tests (vitest, jsdom) and a type check of the extension and its tests. The types
# generated from the schemas must be current; the fixtures are written fresh from real planted-fault
# runs (labextension/scripts/make_fixtures.py), so vitest tests the payloads the kernel really sends.
test-labextension: $(VENV)/.stamp
	cd labextension && { test -d node_modules || npm ci --no-audit --no-fund; } && npm run check:schema
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python labextension/scripts/make_fixtures.py
	cd labextension && npm run typecheck && npm test

# The Colab profile: every notebook (07's two ranks included) and the tests marked colab (the magics,
# widgets, comms, kernels, Trainer callback and fix cells: see tests/conftest.py) on its releases. Colab
# runs one process per runtime: the other multi-rank tests stay on the main lane.
COLAB_TESTS := (notebooks or colab) and not tf450 and not browser and not slow and (notebooks or not multirank)
test-colab: $(COLAB_VENV)/.stamp
	$(COLAB_VENV)/bin/python -m pytest $(PYTEST_PARALLEL) -m "$(COLAB_TESTS)"

test-tf450: $(TF450_VENV)/.stamp
	$(TF450_VENV)/bin/python -m pytest -m tf450

# The frameworks' own entry points on the real packages, one process each (a couple of minutes, most of it
# importing them). axolotl sends telemetry unless told not to: nothing leaves a test run.
test-axolotl: $(AXOLOTL_VENV)/.stamp
	AXOLOTL_DO_NOT_TRACK=1 $(AXOLOTL_VENV)/bin/python -m pytest -m axolotl -p no:cacheprovider tests/test_axolotl_entry.py

test-llamafactory: $(LLAMAFACTORY_VENV)/.stamp
	$(LLAMAFACTORY_VENV)/bin/python -m pytest -m llamafactory -p no:cacheprovider tests/test_llamafactory_entry.py

test-litgpt: $(LITGPT_VENV)/.stamp
	$(LITGPT_VENV)/bin/python -m pytest -m litgpt -p no:cacheprovider tests/test_litgpt_entry.py

test-torchtune: $(TORCHTUNE_VENV)/.stamp
	$(TORCHTUNE_VENV)/bin/python -m pytest -m torchtune -p no:cacheprovider tests/test_torchtune_entry.py

test-quant: $(QUANT_VENV)/.stamp
	$(QUANT_VENV)/bin/python -m pytest -m quant -p no:cacheprovider tests/test_quantized_dry_pass.py \
		tests/test_fix_cell_equals_apply.py

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(COLAB_VENV) $(TF450_VENV) $(QUANT_VENV) $(NEWEST_VENV) $(AXOLOTL_VENV) $(LLAMAFACTORY_VENV) \
		$(LITGPT_VENV) $(TORCHTUNE_VENV) $(UV_TOOL) build dist test-artifacts
	rm -rf labextension/node_modules labextension/lib labextension/build labextension/tsconfig.tsbuildinfo nbguard/labextension
