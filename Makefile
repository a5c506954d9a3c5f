PYTHON := .venv/bin/python

.PHONY: setup engines peers test test-all demo lint

setup:
	bash scripts/setup.sh

# .venv-engines: the speculators library (pinned to an older transformers), for the tests that
# load exported EAGLE-3 drafts with it and check our EAGLE-3 and DFlash training losses and
# gradients against its own (tests/train/test_against_speculators.py); without it they are skipped.
# `python -m experiments.speculators_trainer` trains an EAGLE-3 draft with it beside ours.
engines:
	bash scripts/engine_env.sh

# .venv-peers/: vLLM, OpenVINO GenAI and llama.cpp, one environment each, for
# `python -m experiments.peers`, and ArcticInference's suffix decoding cache alone, for
# `python -m experiments.suffix_reference`; an engine that fails to install is reported and
# skipped.
peers:
	bash scripts/peers.sh

# Tests run on every core (pytest-xdist; each worker's torch on one thread, tests/conftest.py),
# split between the workers, an idle one taking over queued tests of a busy one. JOBS=0: one process.
JOBS ?= auto
PYTEST := $(PYTHON) -m pytest -n $(JOBS) --dist worksteal

# Fast suite: everything except end-to-end runs on the real default model.
test: setup
	$(PYTEST) -m "not slow" -q

test-all: setup
	$(PYTEST) -q

demo: setup
	$(PYTHON) -m experiments.demo

lint: setup
	$(PYTHON) -m ruff check .
