"""Turn benchmark records into Spec-Bench's figures, markdown tables and a bar chart."""

from __future__ import annotations

from pathlib import Path


def summarise(records: dict[str, list[dict]], baseline: str) -> dict:
    """Per method: tokens/s overall and per category, speedup against `baseline` (ratio of
    tokens/s on the same prompts), and for tree methods tau and acceptance per depth."""
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
        methods[name] = summary
    return {"baseline": baseline, "prompts": len(records[baseline]), "methods": methods}


def _tokens_per_second(records: list[dict]) -> dict[str, float]:
    # Spec-Bench: tokens/s of a category = its generated tokens over its wall time.
    totals: dict[str, list[float]] = {}
    for r in records:
        for key in (r["category"], "overall"):
            tokens, seconds = totals.get(key, [0, 0.0])
            totals[key] = [tokens + r["new_tokens"], seconds + r["seconds"]]
    return {cat: tokens / seconds for cat, (tokens, seconds) in totals.items()}


def _step_figures(steps: list[dict]) -> dict:
    """tau, acceptance rate per depth, draft/verify seconds."""
    depth = max(s["tree_depth"] for s in steps)
    per_depth = []
    for d in range(1, depth + 1):
        # a depth-d draft is tried when the tree reaches d and depths 1..d-1 were accepted
        tried = [s for s in steps if s["tree_depth"] >= d and s["accepted"] >= d - 1]
        per_depth.append(sum(s["accepted"] >= d for s in tried) / len(tried) if tried else None)
    return {
        "tau": sum(s["accepted"] + 1 for s in steps) / len(steps),
        "acceptance_per_depth": per_depth,
        "mean_tree_size": sum(s["tree_size"] for s in steps) / len(steps),
        "draft_s": sum(s["draft_s"] for s in steps),
        "verify_s": sum(s["verify_s"] for s in steps),
        "target_forwards": len(steps),
    }


def format_tables(summary: dict) -> str:
    """Two markdown tables: methods overall, and speedup per category."""
    methods = summary["methods"]
    lines = [f"Baseline: {summary['baseline']}, {summary['prompts']} prompts.", "",
             "| method | tokens/s | speedup | tau | accept rate by depth | draft s | verify s |",
             "|---|---|---|---|---|---|---|"]
    for name, m in methods.items():
        tau = f"{m['tau']:.2f}" if "tau" in m else "-"
        rates = ", ".join("-" if r is None else f"{r:.2f}"
                          for r in m.get("acceptance_per_depth", [])) or "-"
        draft = f"{m['draft_s']:.1f}" if "draft_s" in m else "-"
        verify = f"{m['verify_s']:.1f}" if "verify_s" in m else "-"
        lines.append(f"| {name} | {m['tokens_per_s']['overall']:.1f} | "
                     f"{m['speedup']['overall']:.2f}x | {tau} | {rates} | {draft} | {verify} |")
    categories = [c for c in methods[summary["baseline"]]["speedup"] if c != "overall"]
    lines += ["", "| category | " + " | ".join(methods) + " |",
              "|---" * (len(methods) + 1) + "|"]
    for cat in categories:
        cells = " | ".join(f"{m['speedup'][cat]:.2f}x" for m in methods.values())
        lines.append(f"| {cat} | {cells} |")
    return "\n".join(lines)


def plot_speedups(summary: dict, path: Path) -> Path:
    """Grouped bar chart: speedup per category for every method but the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = {n: m for n, m in summary["methods"].items() if n != summary["baseline"]}
    speedups = next(iter(methods.values()))["speedup"]
    categories = [c for c in speedups if c != "overall"] + ["overall"]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8, len(categories) * 0.9), 4))
    for i, (name, m) in enumerate(methods.items()):
        xs = [c + i * width for c in range(len(categories))]
        ax.bar(xs, [m["speedup"][c] for c in categories], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories,
                  rotation=45, ha="right")
    ax.set_ylabel(f"speedup over {summary['baseline']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
