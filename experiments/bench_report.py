"""Turn benchmark records into Spec-Bench's figures, markdown tables and a bar chart.

    python -m experiments.bench_report experiments/reports/<run>/<name>.json

writes <name>.md beside a saved experiments.bench or batch_bench JSON: its tables, generated
from the JSON, never typed.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from experiments.common import save_figure
from experiments.report_schema import BatchSummary, BenchReport, BenchSummary, MethodFigures
from experiments.stats import mean_and_stderr
from experiments.table import cell, markdown_table
from verify.metrics import acceptance_by_depth, accepted_histogram, tau
from verify.runtime.files import write_text


def summarise(records: dict[str, list[dict]], baseline: str,
              reference: str | None = None) -> dict:
    """Per method: tokens/s overall and per category, speedup against `baseline` (ratio of
    tokens/s on the same prompts), and for tree methods tau, acceptance per depth and where a
    step's time goes. With a `reference` method (greedy runs), "identical": the share of
    prompts whose new tokens equal the reference's on the same prompt and run."""
    speeds = {name: _tokens_per_second(recs) for name, recs in records.items()}
    methods = {}
    for name, recs in records.items():
        summary = {
            "tokens_per_s": speeds[name],
            "speedup": {cat: speeds[name][cat] / speeds[baseline][cat] for cat in speeds[name]},
            "new_tokens": sum(r["new_tokens"] for r in recs),
            "seconds": sum(r["seconds"] for r in recs),
        }
        steps = [s for r in recs for s in r.get("steps", [])]
        if steps:
            summary.update(_step_figures(steps))
            summary["acceptance_stderr_per_depth"] = _acceptance_stderr(recs)
            summary.update(_time_per_step(recs, summary))
        summary.update(_draft_memory(recs))
        proposers = _proposers(recs)
        if proposers:
            summary["proposed_by"] = proposers
        if reference is not None:
            summary["identical"] = _identical(recs, records[reference])
        methods[name] = summary
    runs = sorted({r.get("repeat", 0) for r in records[baseline]})
    if len(runs) > 1:
        _add_spread(methods, records, baseline, runs)
    summary = BenchSummary(baseline=baseline, prompts=len(records[baseline]) // len(runs),
                           repeats=len(runs),
                           reference=None if reference in (None, baseline) else reference,
                           methods={name: MethodFigures(**m) for name, m in methods.items()})
    return summary.to_json()


def _add_spread(methods: dict, records: dict[str, list[dict]], baseline: str,
                runs: list[int]) -> None:
    """Each method's overall speedup in every run alone (records tagged `repeat`), and their
    median, min and max: how far one run's figure can be trusted."""
    for name, summary in methods.items():
        if name == baseline:
            continue
        per_run = []
        for run in runs:
            ours = [r for r in records[name] if r.get("repeat", 0) == run]
            base = [r for r in records[baseline] if r.get("repeat", 0) == run]
            per_run.append(_tokens_per_second(ours)["overall"]
                           / _tokens_per_second(base)["overall"])
        summary["speedup_runs"] = per_run
        summary["speedup_median"] = statistics.median(per_run)
        summary["speedup_range"] = [min(per_run), max(per_run)]


def _identical(records: list[dict], reference: list[dict]) -> float:
    """The share of `records` whose tokens equal the `reference` record of the same prompt
    (question_id) and run (repeat)."""
    def key(record: dict) -> tuple:
        return record.get("repeat", 0), record["question_id"]

    expected = {key(r): r["tokens"] for r in reference}
    return sum(r["tokens"] == expected[key(r)] for r in records) / len(records)


def _tokens_per_second(records: list[dict]) -> dict[str, float]:
    # Spec-Bench: tokens/s of a category = its generated tokens over its wall time.
    totals: dict[str, list[float]] = {}
    for r in records:
        for key in (r["category"], "overall"):
            tokens, seconds = totals.get(key, [0, 0.0])
            totals[key] = [tokens + r["new_tokens"], seconds + r["seconds"]]
    return {cat: tokens / seconds for cat, (tokens, seconds) in totals.items()}


def _step_figures(steps: list[dict]) -> dict:
    """tau, acceptance rate per depth, the share of steps accepting 0, 1, 2, ... drafts,
    draft/verify seconds: every figure pooled over the steps of all prompts."""
    accepted = [s["accepted"] for s in steps]
    return {
        "tau": tau(accepted),
        "acceptance_per_depth": acceptance_by_depth(accepted, [s["tree_depth"] for s in steps]),
        "accepted_histogram": accepted_histogram(accepted),
        "mean_tree_size": sum(s["tree_size"] for s in steps) / len(steps),
        # {nodes: share of steps}, the root counted: how a per-step size policy spent them
        "tree_size_histogram": {n: sum(s["tree_size"] == n for s in steps) / len(steps)
                                for n in sorted({s["tree_size"] for s in steps})},
        "draft_s": sum(s["draft_s"] for s in steps),
        "verify_s": sum(s["verify_s"] for s in steps),
        "target_forwards": len(steps),
    }


def _acceptance_stderr(records: list[dict]) -> list[float | None]:
    """Per draft depth: the standard error over prompts (records) of each prompt's acceptance
    at that depth, None where fewer than two prompts tried it. How far a pooled acceptance
    rate could move on other prompts of the same kind."""
    per_prompt = [acceptance_by_depth([s["accepted"] for s in r["steps"]],
                                      [s["tree_depth"] for s in r["steps"]])
                  for r in records if r.get("steps")]
    errors = []
    for depth in range(max((len(rates) for rates in per_prompt), default=0)):
        values = [rates[depth] for rates in per_prompt
                  if depth < len(rates) and rates[depth] is not None]
        errors.append(mean_and_stderr(values)[1] if len(values) > 1 else None)
    return errors


def _proposers(records: list[dict]) -> dict[str, float]:
    """A combinator's share of steps per member that proposed (or "merged"), pooled."""
    counts: dict[str, int] = {}
    for r in records:
        for name, count in r.get("proposed_by", {}).items():
            counts[name] = counts.get(name, 0) + count
    total = sum(counts.values())
    return {name: count / total for name, count in counts.items()} if total else {}


def _draft_memory(records: list[dict]) -> dict:
    """The drafter's own memory where recorded, in MiB: its weights not shared with the target
    and its KV cache at its largest, apart from the target's so a user can budget them."""
    sizes = {key: [r[key] for r in records if key in r]
             for key in ("draft_weights_mb", "draft_cache_mb")}
    return {key: max(values) for key, values in sizes.items() if values}


def _time_per_step(records: list[dict], figures: dict) -> dict:
    """Milliseconds per target forward: drafting, verifying, and the rest of the method's wall
    time (the loop's bookkeeping and the prefill, which is also given alone), so the three add
    up to wall time per step; for drafters with a DraftEngine (records count draft forwards),
    drafting milliseconds per draft forward."""
    draft_s, verify_s, steps = figures["draft_s"], figures["verify_s"], figures["target_forwards"]
    other_s = sum(r["seconds"] for r in records) - draft_s - verify_s
    prefill_s = sum(r.get("prefill_s", 0.0) for r in records)
    times = {f"{part}_ms_per_step": 1000 * seconds / steps for part, seconds in (
        ("draft", draft_s), ("verify", verify_s), ("other", other_s), ("prefill", prefill_s))}
    forwards = [r["draft_forwards"] for r in records if "draft_forwards" in r]
    if forwards:
        times["draft_forwards"] = sum(forwards)
        times["ms_per_draft_forward"] = 1000 * draft_s / sum(forwards) if sum(forwards) else None
    return times


METHOD_HEADER = ["method", "tokens/s", "speedup", "tau", "accept rate by depth",
                 "draft ms/step", "verify ms/step", "loop + prefill ms/step", "ms/draft fwd",
                 "draft MiB (weights, KV)"]


def format_tables(summary: dict) -> str:
    """Markdown tables of a bench summary (a saved JSON's row): methods overall, the trees
    the drafting methods verified, and speedup per category."""
    bench = BenchSummary.from_json(summary)
    methods = bench.methods
    checked = all(m.identical is not None for m in methods.values())  # greedy runs say so
    spread = (f" Speedup: all {bench.runs} runs pooled; median [min, max] of the runs' own "
              "speedups beside it." if bench.runs > 1 else "")
    if any(m.acceptance_stderr_per_depth for m in methods.values()):
        spread += " Depth-1 acceptance ± its standard error over the prompts."
    compared = f"identical to {bench.reference}" if bench.reference else "identical to the baseline"
    header = METHOD_HEADER + ([compared] if checked else [])
    lines = [f"Baseline: {bench.baseline}, {bench.prompts} prompts.{spread}", "",
             markdown_table(header, [_method_cells(name, m) for name, m in methods.items()])]
    drafting = {name: m for name, m in methods.items() if m.drafts}
    if drafting:
        lines += ["", _tree_table(drafting)]
    if bench.memory:
        lines += ["", f"Memory: {bench.memory}."]
    categories = [c for c in methods[bench.baseline].speedup if c != "overall"]
    lines += ["", markdown_table(["category", *methods], [
        [cat, *(f"{m.speedup[cat]:.2f}x" for m in methods.values())] for cat in categories])]
    return "\n".join(lines)


def _tree_table(drafting: dict[str, MethodFigures]) -> str:
    """The trees verified per step (mean size and the commonest sizes, root counted) and
    which member proposed, for the methods that draft."""
    rows = []
    for name, m in drafting.items():
        # benchmarks saved before the histogram was recorded show the mean alone
        sizes = sorted((m.tree_size_histogram or {}).items(), key=lambda kv: -kv[1])[:4]
        common = ", ".join(f"{n}: {share:.0%}" for n, share in sizes) or "-"
        who = ", ".join(f"{k} {v:.0%}" for k, v in (m.proposed_by or {}).items()) or "-"
        rows.append([name, f"{m.mean_tree_size:.2f}", common, who])
    return markdown_table(["method", "mean tree size", "commonest sizes (share of steps)",
                           "proposed by"], rows)


def _loop_and_prefill(m: MethodFigures) -> str | None:
    """The rest of a step's wall time split into the loop's own time (its bookkeeping outside
    drafting and verifying) and the prompt's prefill shared over the steps: "0.2 + 2.0". None
    for a report saved before prefill was recorded (its one figure is shown)."""
    if m.loop_ms_per_step is None:
        return None
    return f"{m.loop_ms_per_step:.1f} + {m.prefill_ms_per_step:.1f}"


TABLE_COLUMNS = ["method", "tokens_per_s", "speedup", "tau", "accept_depth1", "draft_ms_per_step",
                 "verify_ms_per_step", "other_ms_per_step", "draft_weights_mb", "identical"]


def method_table(summary: dict) -> list[list]:
    """One row per method, TABLE_COLUMNS' figures (None where one does not apply): the
    results as a W&B table, where a sweep's runs line up."""
    rows = []
    for name, m in BenchSummary.from_json(summary).methods.items():
        rates = m.acceptance_per_depth or [None]
        rows.append([name, m.tokens_per_s["overall"], m.speedup["overall"], m.tau, rates[0],
                     m.draft_ms_per_step, m.verify_ms_per_step, m.other_ms_per_step,
                     m.draft_weights_mb, m.identical])
    return rows


def _method_cells(name: str, m: MethodFigures) -> list[str]:
    """One row of the methods table; '-' where a figure does not apply to the method."""
    rates = [cell(r) for r in m.acceptance_per_depth or []]
    if rates and m.acceptance_stderr_per_depth and m.acceptance_stderr_per_depth[0] is not None:
        rates[0] += f" ± {m.acceptance_stderr_per_depth[0]:.2f}"  # over prompts
    rates = ", ".join(rates) or "-"
    times = [cell(t, ".1f") for t in (m.draft_ms_per_step, m.verify_ms_per_step,
                                      m.other_ms_per_step, m.ms_per_draft_forward)]
    times[2] = _loop_and_prefill(m) or times[2]
    speedup = f"{m.speedup['overall']:.2f}x"
    if m.speedup_median is not None:
        low, high = m.speedup_range
        speedup += f" ({m.speedup_median:.2f}x [{low:.2f}, {high:.2f}])"
    memory = ("-" if m.draft_weights_mb is None else
              f"{m.draft_weights_mb:.1f}, {cell(m.draft_cache_mb, '.1f')}")
    same = [] if m.identical is None else [f"{m.identical:.0%}"]
    return [name, f"{m.tokens_per_s['overall']:.1f}", speedup, cell(m.tau, ".2f"), rates,
            *times, memory, *same]


def plot_speedups(summary: dict, path: Path) -> Path:
    """Grouped bar chart: speedup per category for every method but the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bench = BenchSummary.from_json(summary)
    methods = {n: m for n, m in bench.methods.items() if n != bench.baseline}
    speedups = next(iter(methods.values())).speedup
    categories = [c for c in speedups if c != "overall"] + ["overall"]
    width = 0.8 / len(methods)
    # wider per category as methods add bars; tab10 repeats colours past ten methods
    colours = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20").colors
    fig, ax = plt.subplots(figsize=(max(8, len(categories) * (0.4 + 0.12 * len(methods))), 4))
    for i, (name, m) in enumerate(methods.items()):
        xs = [c + i * width for c in range(len(categories))]
        ax.bar(xs, [m.speedup[c] for c in categories], width, label=name,
               color=colours[i % len(colours)])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories,
                  rotation=45, ha="right")
    ax.set_ylabel(f"speedup over {bench.baseline}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the bars
    return save_figure(fig, path)


BATCH_HEADER = ["B", "method", "tokens/s", "speedup", "tau", "verify ms/step", "draft share",
                "identical"]


def format_batch_table(summary: dict) -> str:
    """Markdown, one line per batch size and method of a batch summary (a saved JSON's row)."""
    rows = [[size, name, f"{f.tokens_per_s:.1f}", f"{f.speedup:.2f}x", cell(f.tau, ".2f"),
             cell(f.ms_per_step, ".1f"), cell(f.draft_share, ".0%"), cell(f.identical, ".0%")]
            for size, methods in BatchSummary.from_json(summary).sizes.items()
            for name, f in methods.items()]
    return markdown_table(BATCH_HEADER, rows)


def write_tables(json_path: str | Path) -> Path:
    """<name>.md beside a saved experiments.bench or experiments.batch_bench JSON <name>.json:
    its tables, generated from the JSON."""
    json_path = Path(json_path)
    report = BenchReport.read(json_path)
    if isinstance(report.rows[0], BenchSummary):
        formatter = format_tables
    else:
        formatter = format_batch_table
    body = "\n\n".join(formatter(summary.to_json()) for summary in report.rows)
    header = (f"<!-- generated by python -m experiments.bench_report {json_path.name}: "
              "do not edit -->\n")
    path = json_path.with_suffix(".md")
    write_text(path, header + body + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m experiments.bench_report <bench JSON>")
    print(write_tables(sys.argv[1]))
