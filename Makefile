# Everything a fresh machine (Python 3.11, no GPU) needs, from two commands:
#   make demo   run the quickstart notebook headless; executed copies and reports land in build/
#   make test   every test lane: current releases (the docs build and the wheel check included), the Colab
#               profile, transformers 4.50
# Also: make docs (the site, strictly, into build/site/), make wheel (dist/, with the prebuilt Lab extension).
SHELL := /bin/bash
PYTHON ?= python3
SHARED ?= ../shared
# The CPU build of torch lies on this machine's disk; install it before anything that depends on
# torch, or pip pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
PIP_QUIET := -q --disable-pip-version-check
# Two cores: one intra-op thread per test process keeps timings steady.
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

VENV := .venv
COLAB_VENV := .venv-colab
TF450_VENV := .venv-tf450

.PHONY: demo docs wheel test test-main test-labextension test-colab test-tf450 install clean lint

install: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) --upgrade pip
	$(VENV)/bin/pip install $(PIP_QUIET) $(TORCH)
	# pip builds the lab extension through hatch-jupyter-builder: needs node and npm on PATH.
	$(VENV)/bin/pip install $(PIP_QUIET) -e ".[hf,test,browser,trackers,docs]"
	touch $@

# The Colab lane: the versions a Colab GPU runtime ships, held by a constraints file.
$(COLAB_VENV)/.stamp: pyproject.toml $(SHARED)/compat/colab.txt
	$(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/pip install $(PIP_QUIET) --upgrade pip
	$(COLAB_VENV)/bin/pip install $(PIP_QUIET) $(TORCH)
	$(COLAB_VENV)/bin/pip install $(PIP_QUIET) -r $(SHARED)/compat/colab.txt
	$(COLAB_VENV)/bin/pip install $(PIP_QUIET) -e ".[hf,test]" -c $(SHARED)/compat/colab.txt
	touch $@

# The transformers 4.50 lane, where Gemma 3 eval under bf16 really crashes on HybridCache.
$(TF450_VENV)/.stamp: pyproject.toml $(SHARED)/compat/transformers-4.50.txt
	$(PYTHON) -m venv $(TF450_VENV)
	$(TF450_VENV)/bin/pip install $(PIP_QUIET) --upgrade pip
	$(TF450_VENV)/bin/pip install $(PIP_QUIET) $(TORCH)
	$(TF450_VENV)/bin/pip install $(PIP_QUIET) -r $(SHARED)/compat/transformers-4.50.txt
	$(TF450_VENV)/bin/pip install $(PIP_QUIET) -e ".[test]" -c $(SHARED)/compat/transformers-4.50.txt
	touch $@

demo: $(VENV)/.stamp
	$(VENV)/bin/python notebooks/run.py --out build/demo notebooks/00_quickstart.ipynb

# The site, built strictly (a warning fails it) and offline; the executed quickstart is one of its pages.
# tests/test_docs.py runs the same build in test-main, beside the check that no registry entry lacks its page.
docs: demo
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

# The wheel Colab and every non-checkout user installs: the Lab extension is built here (node and npm on
# this machine) and shipped prebuilt, so installing it needs no node (tests/test_wheel.py checks that).
wheel: $(VENV)/.stamp
	$(VENV)/bin/pip wheel . --no-deps $(PIP_QUIET) -w dist/

test: test-main test-labextension test-colab test-tf450

test-main: $(VENV)/.stamp lint
	$(VENV)/bin/python -m pytest -m "not tf450"

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

test-colab: $(COLAB_VENV)/.stamp
	$(COLAB_VENV)/bin/python -m pytest -m "not tf450 and not browser and not slow"

test-tf450: $(TF450_VENV)/.stamp
	$(TF450_VENV)/bin/python -m pytest -m tf450

clean:
	rm -rf $(VENV) $(COLAB_VENV) $(TF450_VENV) build dist test-artifacts
	rm -rf labextension/node_modules labextension/lib labextension/build labextension/tsconfig.tsbuildinfo nbguard/labextension
