"""Size a draft tree from measured costs, Sequoia-style: a static Medusa tree, Sequoia's
dynamic-programming tree, or the node budget of EAGLE-2's dynamic tree.

    python -m experiments.tree_search accuracies=<path to a JSON file> \
        sizes=[1,2,4,8,16,32,64] name=medusa_auto out=conf/tree/medusa_auto.yaml
    python -m experiments.tree_search mode=dynamic drafter=eagle3 \
        drafter.checkpoint=<run>/checkpoint budgets=[4,8,12,16,24,32] depth=5 top_k=8 \
        num_prompts=8 max_new_tokens=64 name=eagle2_auto
    python -m experiments.tree_search mode=sequoia accuracies=<path to a JSON file> \
        sizes=[1,2,4,8,16,32] draft_depth_cost_s=0.004 max_depth=6

mode=static (the default): the JSON holds {"rank_accuracy": [[...], ...]}: rank_accuracy[d][r]
is the probability that the drafter's rank-r proposal at depth d is right (see
drafters.measured_tree). The command times one verification step of n tokens on the target for
each size n, picks the node budget whose best tree gives the most expected tokens per unit of
time (drafters.measured_tree.choose_budget), and writes that tree as a conf/tree YAML.

mode=sequoia: the same table and timing, but the tree of each size is Sequoia's (Chen et al.
2024; drafters.sequoia): the most expected tokens within each depth limit up to max_depth, by
dynamic programming, then the (size, depth) with the most expected tokens per second, the step
costing t(n) plus draft_depth_cost_s per depth level drafted (one draft forward per level for
EAGLE or a draft model; 0 for Medusa, whose heads draft every depth at once). The table sets
it beside today's best-first tree of the same size (drafters.measured_tree), and the Sequoia
tree chosen is written as a conf/tree YAML.

Either of those modes takes accuracies=decode for a drafter with no table of its own (EAGLE,
recycling): the table is then measured by decoding held-out prompts with `drafter` on a
complete tree (measure_depth, measure_top_k; experiments.tree_search_sequoia) and saved as
<out_dir>/<target>-<name>-rank_accuracy.json, which later searches can read.

mode=dynamic: a dynamic tree has no such table, so each budget's tau and draft time are
measured by decoding held-out training prompts (experiments.tree_search_dynamic), and t(n) is
timed for n = budget + 1; the tree with the most predicted tokens/s is written as a conf/tree
YAML (depth, top_k, total_tokens). depth and top_k may be lists (`depth=[2,3,5]
top_k=[2,4,8]`): every budget is then decoded on every shape, taking turns on each prompt
against one timing of t(n), and the best shape is chosen with the budget.

Every mode prints (and writes as JSON) the table behind the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from drafters.measured_tree import (
    build_tree,
    choose_budget,
    expected_tokens,
    rank_order_breaks,
    write_tree_config,
)
from drafters.trees.dynamic import DynamicTree
from experiments.common import check_report, report_name, save_figure, single_thread, write_report
from experiments.table import markdown_table
from experiments.tree_search_dynamic import (
    budget_rows,
    candidate_trees,
    decode_trees,
    describe_machine,
    format_budget_table,
    heldout_prompts,
    measurement_note,
    prompt_data,
    tree_drafters,
    tree_shapes,
    write_dynamic_tree_config,
)
from experiments.tree_search_sequoia import (
    DECODE,
    format_sequoia_table,
    measure_rank_accuracy,
    plot_sequoia,
    sequoia_rows,
)
from verify.costs import measure_verify_cost
from verify.runtime.files import read_json, write_json
from verify.runtime.model import Target, load_target_from_config
from verify.tree import TreeTopology

log = logging.getLogger(__name__)


def load_accuracies(path: str | Path | None) -> list[list[float]]:
    """The "rank_accuracy" table of a JSON file (top level, or under "accuracy" as in the
    eval.json train.py writes): a list over depths of lists over ranks."""
    if path is None:
        raise ValueError('set accuracies=<path to a JSON file with {"rank_accuracy": '
                         '[[p(rank 0 at depth 0), p(rank 1 at depth 0), ...], ...]}>, or '
                         'accuracies=decode to measure drafter=<name> by decoding')
    data = read_json(path, "accuracies")
    # train.py's eval.json keeps the table under "accuracy"; a hand-made file at the top
    nested = data.get("accuracy") if isinstance(data.get("accuracy"), dict) else {}
    table = data.get("rank_accuracy", nested.get("rank_accuracy"))
    if not _is_table(table):
        raise ValueError(f'{path} needs "rank_accuracy": a non-empty list over depths of '
                         f"non-empty lists of per-rank accuracies, got {table!r}")
    table = [[float(a) for a in row] for row in table]
    build_tree(table, 0)  # checks the values now rather than after minutes of measuring
    if isinstance(data.get("steps"), int):  # measured here (accuracies=decode)
        warn_if_few_steps(data["steps"], path)
    return table


# Below this many decoding steps a rank's measured rate has a standard error above 0.05
# (sqrt(p(1 - p) / steps) <= 0.5 / sqrt(steps)): a tree fitted to it may fit the noise.
MIN_STEPS = 100


def warn_if_few_steps(steps: int, source: str | Path) -> None:
    """Warn that a rank-accuracy table from `source` counted too few steps to fit a tree to."""
    if steps < MIN_STEPS:
        log.warning("the rank accuracy in %s was counted over %d decoding steps (< %d): each "
                    "rate is uncertain by up to +-%.2f, and a tree fitted to it may fit the "
                    "noise; measure more (num_prompts, max_new_tokens)", source, steps,
                    MIN_STEPS, 0.5 / max(steps, 1) ** 0.5)


def _is_table(table: object) -> bool:
    # bool is an int to Python, but true/false in an accuracy table is a mistake.
    return (isinstance(table, list) and bool(table)
            and all(isinstance(row, list) and row for row in table)
            and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                    for row in table for a in row))


def size_table(accuracies: Sequence[Sequence[float]], cost: dict[int, float],
               budget: int) -> list[dict]:
    """One row per measured size n: the best tree of n - 1 nodes, its expected tokens and
    predicted speedup over plain decoding, expected tokens * t(1) / t(n)."""
    rows = []
    for n in sorted(cost):
        tree = build_tree(accuracies, n - 1)
        tokens = expected_tokens(tree, accuracies)
        rows.append({"n": n, "nodes": tree.size - 1, "t_s": cost[n], "expected_tokens": tokens,
                     "predicted_speedup": tokens * cost[1] / cost[n], "chosen": n == budget + 1})
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown, one line per size; a tree with fewer nodes than n - 1 is all the table
    has worth drafting, so that size was no candidate."""
    lines = []
    for r in rows:
        note = "**chosen**" if r["chosen"] else ("no candidate" if r["nodes"] < r["n"] - 1
                                                   else "")
        lines.append([r["n"], r["nodes"], f"{1000 * r['t_s']:.1f}",
                      f"{r['expected_tokens']:.3f}", f"{r['predicted_speedup']:.2f}x", note])
    return markdown_table(["n", "nodes", "t(n) ms", "expected tokens", "predicted speedup", ""],
                          lines)


def search(cfg: DictConfig) -> tuple[TreeTopology, list[dict]]:
    """Measure t(n) on the configured target; returns the chosen tree and the size table (a
    warning where the table's ranks make the best-first trees less than the best)."""
    accuracies, cost = table_and_costs(cfg)
    breaks = rank_order_breaks(accuracies)
    if breaks:
        log.warning("the accuracy table's rank r is right more often than rank r - 1 at "
                    "(depth, rank) %s: the best-first tree of a size is then not the best; "
                    "mode=sequoia builds the best by dynamic programming", breaks)
    budget = choose_budget(accuracies, cost)
    return build_tree(accuracies, budget), size_table(accuracies, cost, budget)


def search_sequoia(cfg: DictConfig) -> tuple[TreeTopology, list[dict]]:
    """Measure t(n) on the configured target; returns the chosen Sequoia tree and the table
    of greedy against Sequoia at each size (experiments.tree_search_sequoia)."""
    if cfg.draft_depth_cost_s < 0 or (cfg.max_depth is not None and cfg.max_depth < 1):
        raise ValueError(f"draft_depth_cost_s must be >= 0 and max_depth >= 1 (or null), got "
                         f"{cfg.draft_depth_cost_s}, {cfg.max_depth}")
    accuracies, cost = table_and_costs(cfg)
    return sequoia_rows(accuracies, cost, cfg.draft_depth_cost_s, cfg.max_depth)


def table_and_costs(cfg: DictConfig) -> tuple[list[list[float]], dict[int, float]]:
    """The accuracy table (cfg.accuracies' file, or with accuracies=decode measured by
    decoding with cfg.drafter and saved beside the report) and {n: t(n)} for cfg.sizes on the
    configured target, cfg.draft_cost_s added above n = 1."""
    decode = cfg.accuracies == DECODE
    # A file's values are checked now rather than after minutes of measuring.
    accuracies = None if decode else load_accuracies(cfg.accuracies)
    if 1 not in cfg.sizes:
        raise ValueError(f"sizes must include 1, the plain decoding step every speedup divides "
                         f"by, got {list(cfg.sizes)}")
    target = load_target_from_config(cfg.target)
    # Tiny models run faster on one thread; real ones use torch's default threads.
    with single_thread() if cfg.target.tiny else nullcontext():
        if decode:
            accuracies = _measured_table(cfg, target)
        cost = measure_verify_cost(target.step, list(cfg.sizes), cfg.context_len, cfg.repeats,
                                   cfg.draft_cost_s)
    return accuracies, cost


# The name ending of a measured accuracy table saved beside the reports: an input that
# accuracies= reads, not a report of rows (tests/experiments/test_results.py leaves it out)
RANK_ACCURACY = "-rank_accuracy.json"


def _measured_table(cfg: DictConfig, target: Target) -> list[list[float]]:
    # Saved as a file accuracies= reads, so later searches (another size list, another draft
    # cost) need not decode again.
    table, steps = measure_rank_accuracy(cfg, target)
    path = Path(cfg.out_dir) / f"{report_name(cfg, cfg.name)}{RANK_ACCURACY}"
    write_json(path, {"rank_accuracy": table, "steps": steps, "drafter": cfg.drafter.name,
                      "measure_depth": cfg.measure_depth, "measure_top_k": cfg.measure_top_k,
                      "num_prompts": cfg.num_prompts, "max_new_tokens": cfg.max_new_tokens})
    print(f"rank accuracy of drafter={cfg.drafter.name} over {steps} steps: {path}")
    warn_if_few_steps(steps, path)
    return table


def search_dynamic(cfg: DictConfig) -> tuple[DynamicTree, list[dict], str]:
    """Measure tau and draft time per tree (every budget on every (depth, top_k) shape asked)
    by decoding, and t(budget + 1) and t(1) on the configured target; returns the chosen tree,
    the table and what it was measured on."""
    shapes = tree_shapes(cfg.depth, cfg.top_k)
    stands_for = candidate_trees(list(cfg.budgets), shapes)
    trees = list(stands_for)
    target = load_target_from_config(cfg.target)
    drafters = tree_drafters(cfg.drafter, trees, target, cfg.seed)
    prompts = heldout_prompts(prompt_data(cfg), target, cfg.num_prompts)
    with single_thread() if cfg.target.tiny else nullcontext():
        sizes = sorted({1} | {tree.total_tokens + 1 for tree in trees})
        cost = measure_verify_cost(target.step, sizes, cfg.context_len, cfg.repeats)
        # First calls pay one-off costs (allocations, kernel selection): keep them out.
        decode_trees(target, drafters, prompts[:1], min(cfg.max_new_tokens, 16))
        results = decode_trees(target, drafters, prompts, cfg.max_new_tokens)
        machine = describe_machine(target.model)
    rows = budget_rows(cost, results, stands_for)
    best = next(r for r in rows if r["chosen"])
    return (DynamicTree(best["depth"], best["top_k"], best["total_tokens"]), rows,
            measurement_note(cfg, machine, rows))


def plot_budgets(rows: list[dict], path: Path) -> Path:
    """Tau (expected or measured), predicted speedup and t(n) / t(1) against the node budget:
    where more nodes stop paying on this machine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain = next(r for r in rows if r["n"] == 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    # One line per (depth, top_k) shape asked of a dynamic search, colour by top_k and dash by
    # depth; a static search (rows without shapes) has one line.
    shapes = sorted({tuple(s) for r in rows for s in r.get("shapes") or []}) or [None]
    colours = {k: f"C{i}" for i, k in enumerate(sorted({s[1] for s in shapes if s}))}
    dashes = dict(zip(sorted({s[0] for s in shapes if s}), ["-", "--", ":", "-."] * 4))
    for shape in shapes:
        line = [plain] + [r for r in rows if r is not plain
                          and (shape is None or list(shape) in r["shapes"])]
        style = {} if shape is None else {"color": colours[shape[1]],
                                          "linestyle": dashes[shape[0]]}
        name = "" if len(shapes) == 1 else f"depth {shape[0]}, top-k {shape[1]}"
        budgets = [r["n"] - 1 for r in line]
        left.plot(budgets, [r.get("tau", r.get("expected_tokens")) for r in line], marker="o",
                  label="tau" if len(shapes) == 1 else None, **style)
        right.plot(budgets, [r["predicted_speedup"] for r in line], marker="o",
                   label=name or None, **style)
    sizes = sorted({r["n"] for r in rows})
    t_of = {r["n"]: r["t_s"] for r in rows}
    left.plot([n - 1 for n in sizes], [t_of[n] / plain["t_s"] for n in sizes], marker="s",
              color="black", label="t(n) / t(1)")
    left.set(xlabel="draft nodes verified (n - 1)", ylabel="tokens per step / relative cost")
    left.legend(fontsize=8)
    if len(shapes) > 1:
        left.set_title("tau per shape (the right panel's legend)", fontsize=9)
    chosen = [(r["n"] - 1, r["predicted_speedup"]) for r in rows if r["chosen"]]
    if chosen:
        right.scatter(*zip(*chosen), color="red", zorder=3, label="chosen")
        right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xlabel="draft nodes verified (n - 1)", ylabel="predicted speedup")
    for ax in (left, right):
        ax.set_xscale("symlog", linthresh=1)
    return save_figure(fig, path)


# The modes that build a static tree from an accuracy table: mode -> (search, table, plot,
# the module named in the written tree's header)
TABLE_MODES = {
    "static": (search, format_table, plot_budgets, "drafters.measured_tree"),
    "sequoia": (search_sequoia, format_sequoia_table, plot_sequoia, "drafters.sequoia"),
}


@hydra.main(config_path="../conf", config_name="tree_search", version_base=None)
def main(cfg: DictConfig) -> None:
    if cfg.mode not in (*TABLE_MODES, "dynamic"):  # before `name`, which the mode picks, resolves
        raise ValueError(f"mode must be static (a Medusa tree from an accuracy table), sequoia "
                         f"(Sequoia's tree from the same table) or dynamic (an EAGLE-2 budget "
                         f"from decoding), got {cfg.mode!r}")
    stem = report_name(cfg, cfg.name)
    check_report(cfg.out_dir, stem, cfg)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    if cfg.mode in TABLE_MODES:
        run, format_rows, plot, builder = TABLE_MODES[cfg.mode]
        topology, rows = run(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_tree_config(topology, out, cfg.name, builder)
        table, about = format_rows(rows), f"{topology.size - 1} nodes, depth {topology.depth}"
    else:
        tree, rows, note = search_dynamic(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_dynamic_tree_config(tree, out, cfg.name, note)
        table, about, plot = format_budget_table(rows), note, plot_budgets
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(table)
    print(f"\ntree: {out} ({about})\nJSON: {path}")
    if cfg.plot:
        print(f"plot: {plot(rows, Path(cfg.out_dir) / f'{stem}.png')}")


if __name__ == "__main__":
    main()
