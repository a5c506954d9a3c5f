"""Predict speculative decoding's tokens/s from acceptance and measured costs, Leviathan et al.
(2023) style, and check the prediction against a benchmark run.

    python -m experiments.simulate alpha=0.6 cost_ratio=0.05          # the paper's model
    python -m experiments.simulate costs=<tree_search JSON> bench=<bench JSON> \
        alpha_from=draft_model/chain1                                 # predicted vs measured

A chain of gamma draft tokens, each accepted with probability alpha independently of the
others, yields E = (1 - alpha^(gamma+1)) / (1 - alpha) tokens per target forward (Leviathan
et al., eq. 1). A step costs gamma draft forwards and one verification of gamma + 1 tokens:

    predicted speedup over plain decoding = E * t(1) / (gamma * t_draft + t(gamma + 1))

The paper takes t(n) = t(1) for every n (idle parallel hardware) and t_draft = c * t(1); that is
`cost_ratio=c` alone. `costs=` instead reads t(n) measured on this machine by
`experiments.tree_search` (its JSON rows: n, t_s). alpha: `alpha=` (one or a list), or the
depth-1 acceptance rate of the bench method `alpha_from`, whose ms per draft forward is then
t_draft unless `draft_ms` is given. With `bench=`, every method of that JSON named
"<drafter>/chain<gamma>" (of alpha_from's drafter, when given) is a measured point: its tau
and speedup print beside the prediction, and the plot puts predicted against measured speedup.
The loop overhead (host work, ~2 ms a step here) and non-independent acceptance are what the
model leaves out; the table shows how much they matter.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig

from experiments.common import check_report, own_report_name, save_figure, write_report
from experiments.report_schema import BenchReport, BenchSummary, summary_type
from experiments.stats import leviathan_expected_tokens
from experiments.table import markdown_table
from verify.costs import load_costs
from verify.runtime.files import read_json

CHAIN_METHOD = re.compile(r"/chain(\d+)\b")


def predicted_speedup(alpha: float, gamma: int, t_draft: float, cost: dict[int, float]) -> float:
    """Expected tokens per step over the step's cost, in units of plain decoding's t(1)."""
    if gamma + 1 not in cost:
        raise ValueError(f"no measured t({gamma + 1}) for gamma {gamma}; measured sizes: "
                         f"{sorted(cost)}")
    tokens = leviathan_expected_tokens(alpha, gamma)
    return tokens * cost[1] / (gamma * t_draft + cost[gamma + 1])


def optimal_gamma(alpha: float, t_draft: float, cost: dict[int, float]) -> int:
    """The chain length with the highest predicted speedup among those t(n) covers (0: do not
    speculate). Ties go to the shorter chain."""
    gammas = [n - 1 for n in sorted(cost)]
    return max(gammas, key=lambda g: (predicted_speedup(alpha, g, t_draft, cost)
                                      if g else 1.0, -g))


def constant_cost(t1: float, gammas: Sequence[int]) -> dict[int, float]:
    """The paper's assumption: verifying n tokens costs what one does."""
    return {n: t1 for n in {1, *(g + 1 for g in gammas)}}


def load_bench(path: str | Path) -> BenchSummary:
    """The first summary of an experiments.bench JSON: baseline and per-method figures."""
    data = read_json(path, "bench")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or summary_type(rows[0]) is not BenchSummary:
        raise ValueError(f"{path} is not an experiments.bench JSON (rows[0].methods)")
    return BenchReport.from_json(data, str(path)).rows[0]


def measured_alpha(bench: BenchSummary, method: str) -> tuple[float, float | None]:
    """(depth-1 acceptance rate, ms per draft forward or None) of a bench method."""
    methods = bench.methods
    if method not in methods or not methods[method].acceptance_per_depth:
        drafted = sorted(m for m, v in methods.items() if v.acceptance_per_depth)
        raise ValueError(f"alpha_from: no drafting method {method!r} in the bench JSON; "
                         f"it has {drafted}")
    figures = methods[method]
    return figures.acceptance_per_depth[0], figures.ms_per_draft_forward


def measured_chains(bench: BenchSummary, drafter: str | None = None) -> dict[str, dict]:
    """Bench methods drafting a chain ("<drafter>/chain<gamma>..."), of `drafter` alone when
    given: gamma, tau, speedup."""
    found = {}
    for name, figures in bench.methods.items():
        match = CHAIN_METHOD.search(name)
        if drafter is not None and name.split("/")[0] != drafter:
            continue
        if match and figures.tau is not None:
            found[name] = {"gamma": int(match.group(1)), "tau": figures.tau,
                           "speedup": figures.speedup["overall"]}
    return found


def simulate(cfg: DictConfig) -> list[dict]:
    """One row per (alpha, gamma): expected tokens and predicted speedup; with a bench JSON,
    one row per measured chain method as well, prediction beside measurement."""
    bench = load_bench(cfg.bench) if cfg.bench else None
    alphas, t_draft_ms = _alphas_and_draft_cost(cfg, bench)
    cost = load_costs(cfg.costs) if cfg.costs else None
    if cost is None:
        if cfg.cost_ratio is None:
            raise ValueError("give costs=<tree_search JSON> (measured t(n)) or cost_ratio=<c> "
                             "(the paper's model: t(n) = t(1), a draft forward c * t(1))")
        cost = constant_cost(1.0, cfg.gammas)
        t_draft = cfg.cost_ratio
    elif t_draft_ms is not None:
        t_draft = t_draft_ms / 1000
    elif cfg.cost_ratio is not None:
        t_draft = cfg.cost_ratio * cost[1]
    else:
        raise ValueError("with measured costs, give the draft's cost too: draft_ms=<ms per "
                         "draft forward>, cost_ratio=<c>, or alpha_from=<a bench method>")
    gammas = [g for g in cfg.gammas if g + 1 in cost]
    if not gammas:
        raise ValueError(f"none of gammas {list(cfg.gammas)} has a measured t(gamma + 1); "
                         f"measured sizes: {sorted(cost)}")
    rows = [_row(alpha, g, t_draft, cost) for alpha in alphas for g in gammas]
    if bench is not None:
        drafter = cfg.alpha_from.split("/")[0] if cfg.alpha_from else None
        for name, point in measured_chains(bench, drafter).items():
            if point["gamma"] + 1 in cost:
                row = _row(alphas[0], point["gamma"], t_draft, cost)
                rows.append({**row, "method": name, "measured_tau": point["tau"],
                             "measured_speedup": point["speedup"]})
    return rows


def _alphas_and_draft_cost(cfg: DictConfig, bench: BenchSummary | None
                           ) -> tuple[list[float], float | None]:
    if cfg.alpha_from:
        if bench is None:
            raise ValueError("alpha_from needs bench=<bench JSON>")
        alpha, draft_ms = measured_alpha(bench, cfg.alpha_from)
        return [alpha], cfg.draft_ms if cfg.draft_ms is not None else draft_ms
    if cfg.alpha is None:
        raise ValueError("give alpha=<acceptance rate> (or a list), or alpha_from=<bench "
                         "method> with bench=<bench JSON>")
    alphas = list(cfg.alpha) if isinstance(cfg.alpha, Sequence) and not isinstance(
        cfg.alpha, str) else [cfg.alpha]
    if not all(0 <= a <= 1 for a in alphas):
        raise ValueError(f"alpha must lie in [0, 1], got {alphas}")
    return [float(a) for a in alphas], cfg.draft_ms


def _row(alpha: float, gamma: int, t_draft: float, cost: dict[int, float]) -> dict:
    return {"alpha": alpha, "gamma": gamma,
            "expected_tokens": leviathan_expected_tokens(alpha, gamma),
            "t_draft_ms": 1000 * t_draft, "t_verify_ms": 1000 * cost[gamma + 1],
            "t1_ms": 1000 * cost[1],
            "predicted_speedup": predicted_speedup(alpha, gamma, t_draft, cost),
            "optimal_gamma": optimal_gamma(alpha, t_draft, cost)}


def format_table(rows: list[dict]) -> str:
    """Markdown: predictions per (alpha, gamma), then measured chains beside their prediction."""
    predicted = [[f"{r['alpha']:.3f}", r["gamma"], f"{r['expected_tokens']:.3f}",
                  f"{r['t_draft_ms']:.2f}", f"{r['t_verify_ms']:.2f}",
                  f"{r['predicted_speedup']:.2f}x", r["optimal_gamma"]]
                 for r in rows if "method" not in r]
    tables = [markdown_table(["alpha", "gamma", "expected tokens", "t_draft ms", "t(gamma+1) ms",
                              "predicted speedup", "optimal gamma"], predicted)]
    measured = [[r["method"], r["gamma"], f"{r['expected_tokens']:.2f}",
                 f"{r['measured_tau']:.2f}", f"{r['predicted_speedup']:.2f}x",
                 f"{r['measured_speedup']:.2f}x"] for r in rows if "method" in r]
    if measured:
        tables.append(markdown_table(["method", "gamma", "predicted tau", "measured tau",
                                      "predicted speedup", "measured speedup"], measured))
    return "\n\n".join(tables)


def plot(rows: list[dict], path: Path) -> Path:
    """Predicted speedup against gamma per alpha; measured chains as points, and predicted
    against measured on a second panel when there are any."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "method" in r]
    fig, axes = plt.subplots(1, 2 if measured else 1, figsize=(11 if measured else 6, 4),
                             squeeze=False)
    left = axes[0][0]
    for alpha in sorted({r["alpha"] for r in rows if "method" not in r}):
        curve = [r for r in rows if r["alpha"] == alpha and "method" not in r]
        left.plot([r["gamma"] for r in curve], [r["predicted_speedup"] for r in curve],
                  marker="o", label=f"predicted, alpha={alpha:.2f}")
    if measured:
        left.scatter([r["gamma"] for r in measured], [r["measured_speedup"] for r in measured],
                     color="black", zorder=3, label="measured")
        right = axes[0][1]
        right.scatter([r["predicted_speedup"] for r in measured],
                      [r["measured_speedup"] for r in measured], color="black")
        for r in measured:
            right.annotate(f"gamma={r['gamma']}", (r["predicted_speedup"], r["measured_speedup"]),
                           fontsize=8, xytext=(3, 3), textcoords="offset points")
        low = min(min(r["predicted_speedup"], r["measured_speedup"]) for r in measured) * 0.9
        high = max(max(r["predicted_speedup"], r["measured_speedup"]) for r in measured) * 1.1
        right.plot([low, high], [low, high], color="grey", linestyle="--", label="y = x")
        right.set(xlabel="predicted speedup", ylabel="measured speedup",
                  title="prediction against a real run")
        right.legend()
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set(xlabel="gamma (draft tokens per step)", ylabel="speedup over plain decoding",
             title="chain speculative decoding")
    left.legend(fontsize=8)
    return save_figure(fig, path)


@hydra.main(config_path="../conf", config_name="simulate", version_base=None)
def main(cfg: DictConfig) -> None:
    stem = own_report_name(cfg)
    check_report(cfg.out_dir, stem, cfg)
    rows = simulate(cfg)
    print(format_table(rows))
    out = Path(cfg.out_dir)
    path = write_report(out, stem, rows, cfg)
    print(f"\nJSON: {path}")
    if cfg.plot:
        print(f"plot: {plot(rows, out / f'{stem}.png')}")


if __name__ == "__main__":
    main()
