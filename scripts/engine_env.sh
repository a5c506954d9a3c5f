#!/usr/bin/env bash
# Create .venv-engines: the `speculators` library (what vLLM's EAGLE-3 drafts come from) in an
# environment of its own, for the test that loads our exported folders with it
# (tests/drafters/test_engines.py). speculators 0.9.0 pins transformers<=5.19.0 while treedraft
# runs 5.24, so it cannot share .venv. It is installed without its declared dependencies: those are for its
# training and data-generation tools (datasets, openai, torchvision, torchaudio, a CUDA torch);
# loading and running a draft needs the few listed below. Idempotent, like setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
VENV=.venv-engines
INPUTS=(scripts/engine_env.sh scripts/venv.sh)
if venv_current "$VENV" "${INPUTS[@]}"; then
    exit 0
fi

PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q torch==2.13.0  # the CPU build on this disk, as in setup.sh
# What `import speculators` pulls in (its eagle3 module imports its training data code), in
# speculators' own ranges; not torchvision, torchaudio or a second torch.
"${PIP[@]}" install -q "transformers==5.19.0" safetensors "pydantic>=2" pydantic-settings \
    "loguru>=0.7.2,<=0.7.3" "numpy>=2,<=2.5.4" rich "openai>=2" "datasets>=4,<=5.1.0" \
    hs-connectors==0.9.0
"${PIP[@]}" install -q --no-deps speculators==0.9.0

venv_stamp "$VENV" "${INPUTS[@]}"
