PYTHON := .venv/bin/python

.PHONY: setup engines test test-all demo lint

setup:
	bash scripts/setup.sh

# .venv-engines: the speculators library (pinned to an older transformers), for the test that
# loads exported EAGLE-3 drafts with it; without it that test is skipped.
engines:
	bash scripts/engine_env.sh

# Fast suite: everything except end-to-end runs on the real default model.
test: setup
	$(PYTHON) -m pytest -m "not slow" -q

test-all: setup
	$(PYTHON) -m pytest -q

demo: setup
	$(PYTHON) -m experiments.demo

lint: setup
	$(PYTHON) -m ruff check .
