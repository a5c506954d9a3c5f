"""treedraft side by side with the engines people serve models with, on the same prompts.

    make peers                                # once: .venv-peers/<engine> (scripts/peers.sh)
    python -m experiments.peers               # 13 Spec-Bench prompts, 64 tokens, greedy
    python -m experiments.peers '~engines.vllm.methods.suffix' num_prompts=4   # a method less

The prompts are Spec-Bench questions through the target's chat template, handed to every
engine as token ids, so each decodes exactly the same tokens, greedily, one prompt at a time,
up to `max_new_tokens`, in the target's dtype. treedraft's plain loop and its methods
(`treedraft`: bench compare entries) run here first; then each engine method in a process of
its own (experiments/peer_runners/<engine>_runner.py in that engine's environment: their
pins differ from ours), timed there the same way; then treedraft's plain loop once more, whose
tokens/s beside the first run's shows how far the machine drifted meanwhile.

Per method: tokens/s (generated tokens over the seconds of the generate calls, prefill
included, as experiments.bench counts), its speedup over the same engine's plain decoding
and over treedraft's plain loop, tokens per target step where the engine reports it, and
`identical`: the share of prompts whose output equals treedraft's plain decoding token for
token; treedraft's plain tokens/s is the mean of its two runs, before and after the engines.
Time to first token (a one-token call per prompt) and start-up (loading, compiling) are
reported apart from decode speed. An engine not installed, a method it refuses, a run past
its timeout: a row "not run: <reason>", the other rows intact, exit 0; only a treedraft row
that fails stops the command (they run first).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafters import build_drafter
from drafters.draft_model import truncated_copy
from experiments.bench import Prompt, parse_compare, time_methods, treedraft_method
from experiments.common import (
    CONF_DIR,
    check_report,
    pick_questions,
    publish,
    report_name,
    save_figure,
)
from experiments.processes import run_group
from experiments.table import cell, markdown_table
from verify.metrics import tau
from verify.sampling import SamplingParams
from verify.target.model import (
    DEFAULT_GGUF,
    DEFAULT_NAME,
    Target,
    embedded_gguf_dir,
    load_target_from_config,
)

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
REPO = Path(__file__).resolve().parents[1]
PLAIN = "plain"  # every engine's method name for its plain decoding


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


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens before the first EOS: engines differ in whether they return it."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def treedraft_rows(cfg: DictConfig, target: Target, prompts: list[Prompt],
                   entries: list[str], desc: str, plain: bool = True) -> dict[str, list[dict]]:
    """Records of treedraft's plain loop (unless `plain` is false) and each compare entry on
    `prompts` (bench's timing), greedy."""
    params = SamplingParams()  # greedy
    methods = {"treedraft/plain_loop": treedraft_method(target, None, params)} if plain else {}
    for entry in entries:
        contender = parse_compare(entry)
        drafter = build_drafter(contender.drafter, contender.tree, target)
        methods[f"treedraft/{contender.name}"] = treedraft_method(target, drafter, params,
                                                                 contender.rule)
    timing = OmegaConf.create({"warmup": cfg.warmup, "repeats": 1, "seed": 0,
                               "max_new_tokens": cfg.max_new_tokens})
    return time_methods(methods, prompts, timing, desc=desc, device=target.model.device)


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
    runner = RUNNERS / f"{engine}_runner.py"
    if not runner.is_file():
        return {"error": f"no runner for {engine} ({runner.name} missing)"}
    if not python.is_file():
        return {"error": f"{engine} not installed ({python} missing: make peers)"}
    stem = f"{label or engine}-{request['method']['name']}"
    request_path, result_path = scratch / f"{stem}.json", scratch / f"{stem}.out"
    request_path.write_text(json.dumps(request))
    # one stream in time order: an engine's worker logs the root cause before the engine's
    # own wrapper raises on another stream; past the timeout its workers go with it
    done = run_group([str(python), str(runner), str(request_path), str(result_path)],
                     timeout_s, cwd=scratch, env={**os.environ, **(env or {})})
    if done is None:
        return {"error": f"no result within timeout_s={timeout_s:.0f}"}
    if done[0] != 0 or not result_path.is_file():
        return {"error": failure_reason(done[1], done[0])}
    return read_result(result_path, len(request["prompts"]))


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


def failure_reason(log: str, returncode: int) -> str:
    """Why a run failed: the first exception its log names (the root cause: a chained
    traceback prints it first, and an engine's worker before the engine's own wrapper),
    else the log's last line."""
    found = EXCEPTION.search(log)
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    reason = f"{found.group(1)}: {found.group(2)}" if found else (lines[-1] if lines else
                                                                 "no output")
    return f"{reason[:300]} (exit {returncode})"


def figures(records: list[dict], reference: list[list[int]] | None, eos: set[int]) -> dict:
    """tokens/s, identical share and first-token time of one method's per-prompt records."""
    tokens = sum(len(r["tokens"]) for r in records)
    seconds = sum(r["seconds"] for r in records)
    row = {"new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if reference is not None:
        same = [until_eos(r["tokens"], eos) == until_eos(ref, eos)
                for r, ref in zip(records, reference)]
        row["identical"] = sum(same) / len(same)
    ttfts = [r["ttft_s"] for r in records if "ttft_s" in r]
    row["ttft_s"] = statistics.median(ttfts) if ttfts else None
    steps = [s["accepted"] for r in records for s in r.get("steps", [])]
    row["tokens_per_step"] = tau(steps) if steps else None
    return row


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


def compare(cfg: DictConfig) -> list[dict]:
    """Every row: treedraft's, then each engine method's, then treedraft's plain loop again."""
    engines = typed_engines(cfg.engines)  # a bad engine setting fails before the target loads
    target = load_target_from_config(cfg.target)
    questions = pick_questions(cfg.data_root, cfg.num_prompts, cfg.categories,
                               cfg.warmup)
    prompts = [Prompt(q.category, q.question_id, target.encode_prompt(q.prompt))
               for q in questions]
    eos = set(target.eos_token_ids)
    first = treedraft_rows(cfg, target, prompts, list(cfg.treedraft), "treedraft")
    reference = [r["tokens"] for r in first["treedraft/plain_loop"]]
    rows = [{"method": name, "engine": "treedraft", "step": cfg.target.step,
             **figures(records, reference, eos)} for name, records in first.items()]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = model_folder(target, scratch)
        for engine, engine_cfg in engines.items():
            runner = engine_cfg.runner or engine
            python = (REPO / cfg.venvs / runner / "bin" / "python").absolute()
            for method, settings in engine_cfg.methods.items():
                request = engine_request(
                    cfg, model, target, prompts, method,
                    engine_settings(OmegaConf.to_container(settings), target, scratch),
                    engine_cfg, scratch)
                result = run_engine_method(runner, python, request, engine_cfg.timeout_s,
                                           scratch, dict(engine_cfg.env), label=engine)
                rows.append(engine_row(engine, method, result, reference, eos))
    again = treedraft_rows(cfg, target, prompts, [], "treedraft again")
    rows.append({"method": "treedraft/plain_loop (again)", "engine": "treedraft",
                 "step": cfg.target.step,
                 **figures(again["treedraft/plain_loop"], reference, eos)})
    # the machine may drift over the minutes the engines take: the plain loop before and after
    plain = (rows[0]["tokens_per_s"] + rows[-1]["tokens_per_s"]) / 2
    for row in rows:
        if "tokens_per_s" in row:
            row.setdefault("dtype", cfg.target.dtype)  # a GGUF row names its own weights
            row["speedup_over_treedraft_plain"] = row["tokens_per_s"] / plain
    _speedups_over_engine_plain(rows)
    return rows


def engine_row(engine: str, method: str, result: dict, reference: list[list[int]],
               eos: set[int]) -> dict:
    row = {"method": f"{engine}/{method}", "engine": engine}
    if "error" in result:
        return {**row, "status": f"not run: {result['error']}"}
    row.update(figures(result["rows"], reference, eos), version=result.get("version"),
               startup_s=result.get("startup_s"))
    if "convert_s" in result:  # the model converted to the engine's format, once per run
        row["convert_s"] = result["convert_s"]
    if "weights" in result:  # not the target's own weights (llama.cpp: the GGUF file)
        row["dtype"] = result["weights"]
    row.update(spec_figures(result.get("spec_decode", {}), row["new_tokens"]))
    if method == PLAIN:
        row["tokens_per_step"] = 1.0
    return row


def _speedups_over_engine_plain(rows: list[dict]) -> None:
    plains = {r["engine"]: r["tokens_per_s"] for r in rows
              if "tokens_per_s" in r and r["method"] in (f"{r['engine']}/{PLAIN}",
                                                           "treedraft/plain_loop")}
    for row in rows:
        # a plain decoding that generated nothing (an EOS first) is no measure of speed
        if "tokens_per_s" in row and plains.get(row["engine"]):
            row["speedup_over_engine_plain"] = row["tokens_per_s"] / plains[row["engine"]]


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per method, a "not run" line for each that could not run."""
    header = ["method", "dtype", "tokens/s", "vs its engine's plain", "vs treedraft plain",
              "tokens/step", "identical", "first token ms", "start-up s"]
    table = []
    for r in rows:
        if "status" in r:
            table.append([r["method"], r["status"], "", "", "", "", "", "", ""])
            continue
        dtype = r["dtype"] + (f", {r['step']} step" if r.get("step") else "")
        table.append([r["method"], dtype, cell(r["tokens_per_s"], ".1f"),
                      cell(r.get("speedup_over_engine_plain"), ".2f") + "x",
                      cell(r["speedup_over_treedraft_plain"], ".2f") + "x",
                      cell(r.get("tokens_per_step")), cell(r.get("identical"), ".0%"),
                      cell(r["ttft_s"] * 1000 if r.get("ttft_s") is not None else None, ".0f"),
                      cell(r.get("startup_s"), ".0f")])
    return markdown_table(header, table) + (
        "\n\nGreedy, one prompt at a time, the same token ids for every engine. tokens/s: "
        "generated tokens over the generate calls' seconds (prefill included). identical: "
        "the share of prompts whose output equals treedraft's plain decoding. first token: "
        "the median of a one-token call (treedraft's rows time none). vs treedraft plain: over "
        "the mean of its plain loop's two runs, before and after the engines (the last row; "
        "their ratio is the machine's drift meanwhile).")


def _label(row: dict) -> str:
    """The method, and the weights when they are not the target's (llama.cpp: Q4_1 GGUF)."""
    if row["dtype"].startswith("gguf"):
        return f"{row['method']} ({row['dtype'].split('.')[-2]} GGUF)"
    return row["method"]


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(ran) + 1.2))
    colors = {"treedraft": "tab:blue", "vllm": "tab:orange", "openvino": "tab:purple",
              "llamacpp": "tab:green"}
    ax.barh([_label(r) for r in ran], [r["tokens_per_s"] for r in ran],
            color=[colors.get(r["engine"].split("-")[0], "tab:gray") for r in ran])
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (greedy, one prompt at a time)")
    fig.tight_layout()
    return save_figure(fig, path)


@hydra.main(config_path=CONF_DIR, config_name="peers", version_base=None)
def main(cfg: DictConfig) -> None:
    stem = report_name(cfg, cfg.target.dtype, "peers")
    check_report(cfg.out_dir, stem, cfg)
    torch.manual_seed(0)
    rows = compare(cfg)
    publish(cfg, stem, rows, format_table, plot)


if __name__ == "__main__":
    main()
