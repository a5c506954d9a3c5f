"""Installs that cannot drift: every package of every peer environment (scripts/peers.sh, its
requirement files scripts/peers/<engine>.txt) is pinned exactly, torch is the CPU build and no
CUDA package is named; treedraft's own transformers stays below its next major. Reads files
only: no network, no install."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "peers.sh"
PINS = ROOT / "scripts" / "peers"
PIN = re.compile(r"[a-z0-9][a-z0-9._-]*==[A-Za-z0-9.+!_-]+")  # name==version, nothing else
CPU_TORCH = "torch==2.13.0+cpu"
# Builds of torch's family for another torch, and CUDA's packages: none belongs here
FORBIDDEN = re.compile(r"(torchvision|torchaudio|torchcodec|nvidia-.*|cuda-.*)")
# Environments whose requirement files are installed together (build tools beside the engine)
TOGETHER = {"vllm": ["vllm.txt", "suffix_build.txt"], "arctic": ["arctic.txt", "suffix_build.txt"],
            "llamacpp": ["llamacpp_build.txt", "llamacpp.txt"]}


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def pinned(path: Path) -> dict[str, str]:
    """{canonical name: version} of a requirement file (its pins checked by the test below)."""
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1]
            for line in requirement_lines(path)}


REQUIREMENT_FILES = sorted(PINS.glob("*.txt"))


def test_there_is_a_requirement_file_per_engine_and_the_script_installs_each():
    script = SCRIPT.read_text()
    names = {path.name for path in REQUIREMENT_FILES}
    assert {"vllm.txt", "openvino.txt", "llamacpp.txt", "arctic.txt"} <= names
    for name in names:
        assert re.search(rf"\bpinned \S+ {re.escape(name)}\b", script), f"{name} is not installed"


@pytest.mark.parametrize("path", REQUIREMENT_FILES, ids=lambda p: p.name)
def test_every_line_of_a_requirement_file_is_an_exact_pin(path):
    lines = requirement_lines(path)
    assert lines, f"{path.name} pins nothing"
    loose = [line for line in lines if not PIN.fullmatch(line)]
    assert not loose, f"{path.name}: not name==version: {loose}"
    names = [canonicalize_name(line.split("==")[0]) for line in lines]
    assert len(names) == len(set(names)), f"{path.name} names a package twice"


@pytest.mark.parametrize("path", REQUIREMENT_FILES, ids=lambda p: p.name)
def test_torch_is_the_cpu_build_and_no_cuda_package_is_named(path):
    for line in requirement_lines(path):
        name = canonicalize_name(line.split("==")[0])
        assert not FORBIDDEN.fullmatch(name), f"{path.name} names {line}"
        if name == "torch":
            assert line == CPU_TORCH, f"{path.name}: {line}, not {CPU_TORCH}"


@pytest.mark.parametrize("environment", sorted(TOGETHER))
def test_files_installed_together_agree(environment):
    seen: dict[str, tuple[str, str]] = {}
    for file in TOGETHER[environment]:
        for name, version in pinned(PINS / file).items():
            earlier = seen.setdefault(name, (version, file))
            assert earlier[0] == version, (f"{environment}: {name}=={earlier[0]} in {earlier[1]}, "
                                           f"=={version} in {file}")


def code(script: str) -> str:
    """The script without its comments (whole lines, and " # ..." after a command), its
    continued lines joined."""
    lines = (line.split(" # ", 1)[0] for line in script.replace("\\\n", " ").splitlines())
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def pip_commands(script: str) -> list[list[str]]:
    """The arguments after `pip install` / `pip download` in each of the script's commands."""
    commands = []
    for line in script.splitlines():
        for match in re.finditer(r"\bpip\b[\"'\]}]*\s+(install|download)\s+(.*?)(?:&&|$)", line):
            commands.append(shlex.split(match.group(2)))
    return commands


# pip options that take a value (the next word), as the script uses them
VALUED = {"-r", "-c", "-d", "--requirement", "--constraint", "--dest", "--cache-dir",
          "--no-binary", "--only-binary"}


def test_every_package_the_script_installs_is_pinned_or_comes_from_a_requirement_file():
    script = code(SCRIPT.read_text())
    commands = pip_commands(script)
    assert len(commands) >= 3, commands  # pip itself, the requirement files, the sdist
    for arguments in commands:
        words = iter(arguments)
        for word in words:
            if word in VALUED:
                next(words)
            elif not word.startswith("-") and word != "$@":  # "$@": pinned()'s options
                assert "==" in word, f"scripts/peers.sh installs {word!r} unpinned: {arguments}"
    # what the script hands pinned() besides a requirement file are pip options, no packages
    for call in re.findall(r"\bpinned (\S+ \S+\.txt.*?)(?:&&|$)", script, re.M):
        extra = shlex.split(call)[2:]
        assert all(word.startswith("-") for word in extra), f"pinned {call}"
    # the versions in variables are literal
    assert re.search(r"^PIP_VERSION=\d+(\.\d+)+$", script, re.M)
    assert re.search(r"\bversion=\d+(\.\d+)+$", script, re.M)  # arctic-inference's
    # nothing resolved: a requirement file's packages go in without their dependencies
    assert re.search(r"pip install [^\n]*--no-deps[^\n]*-r ", script)


def test_transformers_is_bounded_below_its_next_major():
    """A new major (6) may drop the extension points the verifier uses (custom 4D masks, the
    Cache API): `pip install -e .` must not pick it up unasked."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = next(Requirement(d) for d in project["dependencies"]
                if canonicalize_name(Requirement(d).name) == "transformers")
    assert spec.specifier.contains("5.25.0") and not spec.specifier.contains("6.0.0")
