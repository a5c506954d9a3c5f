PYTHON := .venv/bin/python

.PHONY: setup test test-all demo lint

setup:
	bash scripts/setup.sh

# Fast suite: everything except end-to-end runs on the real default model.
test: setup
	$(PYTHON) -m pytest -m "not slow" -q

test-all: setup
	$(PYTHON) -m pytest -q

demo: setup
	$(PYTHON) -m experiments.demo

lint: setup
	$(PYTHON) -m ruff check .
