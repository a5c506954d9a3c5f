"""treedraft side by side with the engines people serve models with, on the same prompts.

    make peers                                # once: .venv-peers/<engine> (scripts/peers.sh)
    python -m experiments.peers               # 13 Spec-Bench prompts, 64 tokens, greedy
    python -m experiments.peers '~engines.vllm.methods.suffix' num_prompts=4   # a method less

The prompts are Spec-Bench questions through the target's chat template, handed to every
engine as token ids, so each decodes exactly the same tokens, greedily, one prompt at a time,
up to `max_new_tokens`, in the target's dtype. treedraft's plain loop and its methods
(`treedraft`: bench compare entries) run here first; then each engine method in a process of
its own (experiments.engines: experiments/peer_runners/<engine>_runner.py in that engine's
environment, whose pins differ from ours), timed there the same way; then treedraft's plain
loop once more, whose tokens/s beside the first run's shows how far the machine drifted
meanwhile.

Per method: tokens/s (generated tokens over the seconds of the generate calls, prefill
included, as experiments.methods.time_methods counts), its speedup over the same engine's
plain decoding and over treedraft's plain loop, tokens per target step where the engine
reports it, and `identical`: the share of prompts whose output equals treedraft's plain
decoding token for token (up to the first EOS); treedraft's plain tokens/s is the mean of
its two runs, before and after the engines.
Time to first token (a one-token call per prompt) and start-up (loading, compiling) are
reported apart from decode speed. An engine not installed, a method it refuses, a run past
its timeout: a row "not run: <reason>", the other rows intact, exit 0; only a treedraft row
that fails stops the command (they run first).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.common import CONF_DIR, report_name, report_rows, save_figure
from experiments.engines import (
    engine_request,
    engine_settings,
    identical_share,
    model_folder,
    run_engine_method,
    spec_figures,
    typed_engines,
    venv_python,
)
from experiments.methods import spec_bench_prompts, treedraft_records
from experiments.table import cell, markdown_table
from verify.metrics import tau
from verify.runtime.model import load_target_from_config

PLAIN = "plain"  # every engine's method name for its plain decoding


def figures(records: list[dict], reference: list[list[int]] | None, eos: set[int]) -> dict:
    """tokens/s, identical share and first-token time of one method's per-prompt records."""
    tokens = sum(len(r["tokens"]) for r in records)
    seconds = sum(r["seconds"] for r in records)
    row = {"new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if reference is not None:
        row["identical"] = identical_share([r["tokens"] for r in records], reference, eos)
    ttfts = [r["ttft_s"] for r in records if "ttft_s" in r]
    row["ttft_s"] = statistics.median(ttfts) if ttfts else None
    steps = [s["accepted"] for r in records for s in r.get("steps", [])]
    row["tokens_per_step"] = tau(steps) if steps else None
    return row


def compare(cfg: DictConfig) -> list[dict]:
    """Every row: treedraft's, then each engine method's, then treedraft's plain loop again."""
    engines = typed_engines(cfg.engines)  # a bad engine setting fails before the target loads
    target = load_target_from_config(cfg.target)
    prompts = spec_bench_prompts(cfg, target, cfg.warmup)
    eos = set(target.eos_token_ids)
    first = treedraft_records(cfg, target, prompts, list(cfg.treedraft), "treedraft")
    reference = [r["tokens"] for r in first["treedraft/plain_loop"]]
    rows = [{"method": name, "engine": "treedraft", "step": cfg.target.step,
             **figures(records, reference, eos)} for name, records in first.items()]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = model_folder(target, scratch)
        for engine, engine_cfg in engines.items():
            runner = engine_cfg.runner or engine
            python = venv_python(Path(cfg.venvs) / runner)
            for method, settings in engine_cfg.methods.items():
                request = engine_request(
                    cfg, model, target, prompts, method,
                    engine_settings(OmegaConf.to_container(settings), target, scratch),
                    engine_cfg, scratch)
                result = run_engine_method(runner, python, request, engine_cfg.timeout_s,
                                           scratch, dict(engine_cfg.env), label=engine)
                rows.append(engine_row(engine, method, result, reference, eos))
    again = treedraft_records(cfg, target, prompts, [], "treedraft again")
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
    report_rows(cfg, report_name(cfg, cfg.target.dtype, "peers"), compare, format_table, plot)


if __name__ == "__main__":
    main()
