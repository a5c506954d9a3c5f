"""Engine clients: a method of another engine (vLLM, OpenVINO GenAI, llama.cpp,
ArcticInference's suffix cache, optimum-intel's exported graph) run from here, in that
engine's own virtual environment (.venv-peers/<engine>: its pins differ from ours), by its
runner, experiments/peer_runners/<runner>_runner.py, in a process group of its own.

A runner is handed a request, a JSON file (`engine_request`: the model folder, the prompts
as token ids, the method and its settings), and writes its result file, read back and checked
here (`read_result`: per prompt, its new tokens and the seconds of its generate call; a
runner can exit 0 and still write nonsense), or fails, its reason the first exception its log
names (`failure_reason`). The model folder an engine loads is the one the target was loaded
from, or the target saved for it when it was built here (`model_folder`, a tiny random one).

experiments.peers, served, suffix_reference, step_limit and regenerate are the clients.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafters.draft_model import truncated_copy
from experiments.processes import run_group
from verify.loop import until_eos
from verify.runtime.model import DEFAULT_GGUF, DEFAULT_NAME, Target, embedded_gguf_dir

if TYPE_CHECKING:
    from experiments.methods import Prompt

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
REPO = Path(__file__).resolve().parents[1]


def venv_python(venv: str | Path) -> Path:
    """The python of the environment `venv` (a folder relative to the repository, or absolute),
    whether it is installed or not."""
    return (REPO / venv / "bin" / "python").absolute()


@dataclass
class EngineConfig:
    """One engine of conf/peers.yaml's `engines`: its methods ({name: settings}; "plain" is
    its plain decoding), the seconds one method may take, what its runner takes besides
    (`options`, handed over in the request), the environment variables of its processes
    (`env`), and `runner`: the runner and environment it runs in when they are another
    engine's (the same engine under other settings; None: its own name's)."""

    timeout_s: float = MISSING
    options: dict[str, Any] = field(default_factory=dict)
    methods: dict[str, Any] = MISSING
    env: dict[str, str] = field(default_factory=dict)
    runner: str | None = None


def typed_engines(engines: DictConfig) -> dict[str, DictConfig]:
    """Each engine's settings typed by EngineConfig; ValueError naming engines.<name>.<key>."""
    typed = {}
    for name, settings in engines.items():
        try:
            typed[name] = OmegaConf.merge(OmegaConf.structured(EngineConfig), settings)
            OmegaConf.to_container(typed[name], throw_on_missing=True)
        except OmegaConfBaseException as e:
            raise ValueError(f"engines.{name}: {e}") from e
        check_runner_name(name, typed[name].runner or name)
    return typed


def check_runner_name(engine: str, runner: str) -> None:
    """Refuse an engine or runner that is not a plain name (a runner is a file in RUNNERS,
    <runner>_runner.py; "../x" would run a script from anywhere), naming the ones there."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", engine) or not re.fullmatch(r"[A-Za-z0-9_-]+", runner):
        known = sorted(p.name.removesuffix("_runner.py") for p in RUNNERS.glob("*_runner.py"))
        raise ValueError(f"engines.{engine}: runner {runner!r} is not a runner's name: runners "
                         f"are files in {RUNNERS} ({', '.join(known)})")


def model_folder(target: Target, scratch: Path) -> str:
    """A folder the engines load the target from: the one it was loaded from, else (a tiny
    random target) its weights and config saved under `scratch`."""
    loaded_from = str(target.model.config._name_or_path)  # "" for a model built here
    if loaded_from and (Path(loaded_from) / "config.json").is_file():
        return loaded_from
    target.model.save_pretrained(scratch / "model")
    return str(scratch / "model")


def engine_settings(settings: dict, target: Target, scratch: Path) -> dict:
    """A method's settings as its runner reads them: `draft_layers: N` becomes `draft: <a
    folder>` holding the target's first N layers and its tokenizer, the self-draft that
    treedraft's `draft_model:<tree>:num_layers=N` drafts with, for an engine's draft-model
    method."""
    layers = settings.pop("draft_layers", None)
    if layers is None:
        return settings
    folder = scratch / f"draft-{layers}-layers"
    if not (folder / "config.json").is_file():
        truncated_copy(target.model, layers).save_pretrained(folder)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(folder)
    return {**settings, "draft": str(folder)}


def gguf_file(target: Target) -> str | None:
    """The GGUF file the target ships as (llama.cpp reads only those): the default target's
    embedded one; None for another."""
    if target.name != DEFAULT_NAME:
        return None
    return str(embedded_gguf_dir() / DEFAULT_GGUF)


def engine_request(cfg: DictConfig, model: str, target: Target, prompts: list[Prompt],
                   method: str, settings: dict, engine_cfg: DictConfig, scratch: Path) -> dict:
    """What a runner is given (experiments/peer_runners/: the request they read); `work_dir`
    is where a runner may keep what it converts, for the run's other methods."""
    return {"model": model, "gguf": gguf_file(target), "work_dir": str(scratch),
            "dtype": cfg.target.dtype,
            "prompts": [p.ids.tolist() for p in prompts],
            "max_new_tokens": cfg.max_new_tokens, "eos_token_ids": list(target.eos_token_ids),
            "warmup": cfg.warmup, "max_model_len": cfg.max_model_len,
            "method": {"name": method, **settings},
            **OmegaConf.to_container(engine_cfg.options)}


def run_engine_method(engine: str, python: Path, request: dict, timeout_s: float,
                      scratch: Path, env: dict[str, str] | None = None,
                      label: str | None = None) -> dict:
    """Run one method with `engine`'s runner in its own process (`env`: variables added to
    its environment; `label`: the entry's name, for its files); its result, or {"error":
    <reason>}."""
    stem = f"{label or engine}-{request['method']['name']}"
    outcome = run_runner(engine, python, request, timeout_s, scratch, stem, env)
    if isinstance(outcome, str):
        return {"error": outcome}
    return read_result(outcome, len(request["prompts"]))


def run_runner(runner: str, python: Path, request: dict, timeout_s: float, scratch: Path,
               stem: str, env: dict[str, str] | None = None,
               timeout_name: str = "timeout_s", echo: Callable[[str], None] | None = None
               ) -> Path | str:
    """Run RUNNERS/<runner>_runner.py with `python` on `request` (written to
    <scratch>/<stem>.json), in `scratch`, with `env` added to its environment: the path of
    the result file it wrote, or why there is none (no such runner, `python` not installed,
    a run past `timeout_s` seconds, the setting `timeout_name`, a failure). `echo`: shown
    its output as it comes (processes.run_group)."""
    script = RUNNERS / f"{runner}_runner.py"
    if not script.is_file():
        return f"no runner for {runner} ({script.name} missing)"
    if not python.is_file():
        return f"{runner} not installed ({python} missing: make peers)"
    request_path, result_path = scratch / f"{stem}.json", scratch / f"{stem}.out"
    request_path.write_text(json.dumps(request))
    # one stream in time order: an engine's worker logs the root cause before the engine's
    # own wrapper raises on another stream; past the timeout its workers go with it
    done = run_group([str(python), str(script), str(request_path), str(result_path)],
                     timeout_s, echo, cwd=scratch, env={**os.environ, **(env or {})})
    if done is None:
        return f"no result within {timeout_name}={timeout_s:.0f}"
    if done[0] != 0 or not result_path.is_file():
        return failure_reason(done[1], done[0])
    return result_path


def read_result(path: Path, prompts: int) -> dict:
    """A runner's result file: {"rows": [one {"tokens", "seconds"} per prompt], ...}, or
    {"error": <what is wrong with it>} (a runner can exit 0 and still write nonsense)."""
    try:
        result = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return {"error": f"its result is not JSON ({error})"}
    rows = result.get("rows") if isinstance(result, dict) else None
    if not isinstance(rows, list) or len(rows) != prompts or not all(
            isinstance(r, dict) and isinstance(r.get("tokens"), list)
            and isinstance(r.get("seconds"), (int, float)) for r in rows):
        return {"error": f"its result holds no `rows` of {prompts} prompts' tokens and seconds"}
    untimed = next((i for i, r in enumerate(rows) if not is_duration(r["seconds"])), None)
    if untimed is not None:  # tokens/s would divide by it
        return {"error": f"its result times prompt {untimed} at {rows[untimed]['seconds']!r} "
                         "seconds: a decode takes a positive, finite time (does the runner "
                         "read its clock around the generate call?)"}
    return result


def is_duration(seconds: float) -> bool:
    """A time a decode can have taken: positive and finite (JSON also carries NaN, Infinity)."""
    return math.isfinite(seconds) and seconds > 0


EXCEPTION = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")


# pydantic's "N validation error(s) for <Model>", whose reasons follow on the next lines
VALIDATION = re.compile(r"\d+ validation errors? for \w+$")


def failure_reason(log: str, returncode: int) -> str:
    """Why a run failed: the first exception its log names (the root cause: a chained
    traceback prints it first, and an engine's worker before the engine's own wrapper), with
    the two lines under it where it is a pydantic validation error (vLLM's config checks:
    which field, and why), else the log's last line."""
    found = EXCEPTION.search(log)
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    reason = f"{found.group(1)}: {found.group(2)}" if found else (lines[-1] if lines else
                                                                 "no output")
    if found and VALIDATION.search(found.group(2).strip()):
        after = [line.strip() for line in log[found.end():].splitlines() if line.strip()]
        reason = "; ".join([reason.strip(), *after[:2]])
    return f"{reason[:300]} (exit {returncode})"


def identical_share(outputs: list[list[int]], reference: list[list[int]],
                    eos: set[int]) -> float:
    """The share of `outputs` equal to the `reference` outputs of the same prompts, token for
    token up to the first EOS, which is left out (engines differ in whether they return it)."""
    same = [until_eos(output, eos, keep_eos=False) == until_eos(ref, eos, keep_eos=False)
            for output, ref in zip(outputs, reference)]
    return sum(same) / len(same)


def spec_figures(counters: dict, new_tokens: int) -> dict:
    """Tokens per target step and acceptance by draft position from vLLM-style spec-decode
    counters over the timed prompts (drafts proposed, drafts accepted, accepted per position)
    and the `new_tokens` those prompts generated. Each step emits its accepted drafts and one
    token of its own, so the steps number new_tokens - accepted, whether they drafted or not
    (an n-gram proposer drafts only where it finds a match)."""
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    if not drafts or accepted >= new_tokens:  # no drafting, or counters of other calls too
        return {}
    positions = sorted((int(key.split("[")[1].rstrip("]")), value)
                       for key, value in counters.items() if key.endswith("]"))
    return {"tokens_per_step": new_tokens / (new_tokens - accepted),
            "drafting_steps": drafts, "accepted_drafts": accepted,
            # per draft position: accepted there over the steps that drafted
            "acceptance_by_position": [value / drafts for _, value in positions]}
