"""experiments.tree_search mode=sequoia: Sequoia's tree (drafters.sequoia) against today's
best-first tree (drafters.measured_tree.build_tree) at each measured size, from one accuracy
table and one set of measured costs.

Both trees pay the same step cost at size n: t(n) (with any fixed draft cost the timing added)
plus `draft_depth_s` per depth level drafted. Sequoia picks, per size, the depth limit with the
most expected tokens per second, and the size to ship among all of them; the greedy tree keeps
its own depth, as the static search ships it.

The accuracy table of a drafter without one of its own (train.py's eval.json has Medusa's;
EAGLE and Token Recycling have none) is measured by decoding (`accuracies=decode`): held-out
prompts decoded greedily with the drafter filling the complete tree of `measure_depth` levels
and `measure_top_k` children per node, and counted at every step (RankTally) along the accepted
path. Row d is then Sequoia's positional acceptance, conditional on the path so far: of the
steps whose accepted depth-d node had children, the share that accepted its rank-r child.
Medusa's eval.json rows are each head's own accuracy instead (teacher-forced, unconditional).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from drafters import build_drafter
from drafters.measured_tree import build_tree, expected_tokens
from drafters.sequoia import SequoiaTable, best_candidate, candidates
from experiments.common import save_figure
from experiments.table import markdown_table
from experiments.tree_search_dynamic import heldout_prompts, prompt_data
from verify.accept import Acceptance, AcceptanceRule, GreedyRule
from verify.loop import generate
from verify.runtime.model import Target
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeBatch, TreeTopology

# accuracies=<this>: measure the table by decoding instead of reading a file
DECODE = "decode"


def sequoia_rows(accuracies: Sequence[Sequence[float]], cost: dict[int, float],
                 draft_depth_s: float, max_depth: int | None
                 ) -> tuple[TreeTopology, list[dict]]:
    """The chosen Sequoia tree and one row per measured size n (cost: {n: t(n)}, 1 included):
    the greedy and the Sequoia tree of n - 1 nodes, their depth, expected tokens and predicted
    speedup over plain decoding, tokens * t(1) / (t(n) + depth * draft_depth_s)."""
    if 1 not in cost:
        raise ValueError(f"cost needs t(1), the plain step every speedup divides by: {cost}")
    table = SequoiaTable(accuracies, max(cost) - 1, max_depth)
    found = candidates(table, cost, draft_depth_s)
    chosen = best_candidate([c for per_size in found.values() for c in per_size])
    rows = []
    for n in sorted(cost):
        best = best_candidate(found[n]) if n in found else None
        tree = best.tree if best else table.tree(n - 1, table.max_depth)
        greedy = build_tree(accuracies, n - 1)
        greedy_tokens = expected_tokens(greedy, accuracies)
        tokens = best.tokens if best else table.tokens(n - 1, table.max_depth)
        rows.append({
            "n": n, "t_s": cost[n], "draft_depth_s": draft_depth_s,
            **_side("greedy", greedy, greedy_tokens, cost, draft_depth_s, n),
            **_side("sequoia", tree, tokens, cost, draft_depth_s, n),
            # the DP's most at this size whatever the draft cost (>= greedy's unless
            # max_depth cuts greedy's tree)
            "sequoia_best_tokens": table.tokens(n - 1, table.max_depth),
            "candidate": best is not None, "chosen": best is chosen})
    return chosen.tree, rows


def _side(name: str, tree: TreeTopology, tokens: float, cost: dict[int, float],
          draft_depth_s: float, n: int) -> dict:
    """One tree's columns; its step costs t(n) and a draft forward per depth level."""
    step_s = cost[n] + tree.depth * draft_depth_s
    return {f"{name}_nodes": tree.size - 1, f"{name}_depth": tree.depth,
            f"{name}_tokens": tokens, f"{name}_speedup": tokens * cost[1] / step_s}


def format_sequoia_table(rows: list[dict]) -> str:
    """Markdown, one line per size: greedy against Sequoia at equal size; a size without a
    Sequoia tree of n - 1 nodes worth drafting was no candidate."""
    lines = []
    for r in rows:
        note = "**chosen**" if r["chosen"] else ("" if r["candidate"] else "no candidate")
        lines.append([r["n"], f"{1000 * r['t_s']:.1f}",
                      f"{r['greedy_nodes']} / {r['greedy_depth']}", f"{r['greedy_tokens']:.3f}",
                      f"{r['greedy_speedup']:.2f}x",
                      f"{r['sequoia_nodes']} / {r['sequoia_depth']}",
                      f"{r['sequoia_tokens']:.3f}", f"{r['sequoia_speedup']:.2f}x",
                      f"{r['sequoia_best_tokens']:.3f}", note])
    header = ["n", "t(n) ms", "greedy nodes / depth", "greedy tokens", "greedy speedup",
              "Sequoia nodes / depth", "Sequoia tokens", "Sequoia speedup",
              "most tokens, depth <= max", ""]
    return markdown_table(header, lines)


def plot_sequoia(rows: list[dict], path: Path) -> Path:
    """Expected tokens and predicted speedup against the node budget, greedy and Sequoia."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    budgets = [r["n"] - 1 for r in rows]
    for name, style in (("greedy", "--"), ("sequoia", "-")):
        label = "Sequoia" if name == "sequoia" else "greedy (static search)"
        left.plot(budgets, [r[f"{name}_tokens"] for r in rows], style, marker="o", label=label)
        right.plot(budgets, [r[f"{name}_speedup"] for r in rows], style, marker="o",
                   label=label)
    left.plot(budgets, [r["sequoia_best_tokens"] for r in rows], ":", color="grey",
              label="Sequoia, any depth")
    t1 = next(r["t_s"] for r in rows if r["n"] == 1)
    left.plot(budgets, [r["t_s"] / t1 for r in rows], marker="s", color="black",
              label="t(n) / t(1)")
    left.set(xlabel="draft nodes verified (n - 1)", ylabel="tokens per step / relative cost")
    chosen = [(r["n"] - 1, r["sequoia_speedup"]) for r in rows if r["chosen"]]
    right.scatter(*zip(*chosen), color="red", zorder=3, label="chosen")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xlabel="draft nodes verified (n - 1)", ylabel="predicted speedup")
    for ax in (left, right):
        ax.set_xscale("symlog", linthresh=1)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def complete_tree(depth: int, top_k: int) -> TreeTopology:
    """Every node above `depth` with `top_k` children: top_k + top_k^2 + ... + top_k^depth
    nodes, so that every accepted node offers every rank the table measures."""
    if depth < 1 or top_k < 1:
        raise ValueError(f"measure_depth and measure_top_k must be >= 1, got {depth}, {top_k}")
    levels = [[()]]
    for _ in range(depth):
        levels.append([path + (r,) for path in levels[-1] for r in range(top_k)])
    return TreeTopology.from_choices([p for level in levels[1:] for p in level])


class RankTally(AcceptanceRule):
    """Accepts as `inner` does, and counts along each accepted path which rank was accepted
    at each depth: the raw counts of an accuracy table (depth x top_k)."""

    def __init__(self, inner: AcceptanceRule, depth: int, top_k: int):
        self.inner, self.name, self.exact = inner, inner.name, inner.exact
        self.reached = [0] * depth  # steps whose accepted depth-d node had children
        self.hits = [[0] * top_k for _ in range(depth)]  # ... and accepted its rank-r child

    def __call__(self, tree: TokenTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Acceptance:
        acceptance = self.inner(tree, logits, params, generator)
        self.count(tree, acceptance.path)
        return acceptance

    def accept_batch(self, trees: Sequence[TokenTree], batch: TreeBatch, logits: torch.Tensor,
                     params: SamplingParams, generator: torch.Generator | None = None
                     ) -> list[Acceptance]:
        acceptances = self.inner.accept_batch(trees, batch, logits, params, generator)
        for tree, acceptance in zip(trees, acceptances):
            self.count(tree, acceptance.path)
        return acceptances

    def count(self, tree: TokenTree, path: Sequence[int]) -> None:
        """Tally one step: `path` is its accepted node indices from the root (0)."""
        for depth, node in enumerate(path[:len(self.reached)]):
            kids = tree.children(node)  # in proposal order: rank order
            if not kids:
                break  # a leaf: the step says nothing about deeper ranks
            self.reached[depth] += 1
            rank = kids.index(path[depth + 1]) if depth + 1 < len(path) else None
            if rank is not None and rank < len(self.hits[depth]):
                self.hits[depth][rank] += 1

    def table(self) -> list[list[float]]:
        """rank_accuracy[d][r]: hits over steps reaching depth d (0 where none did)."""
        return [[h / reached if reached else 0.0 for h in row]
                for row, reached in zip(self.hits, self.reached)]


def measure_rank_accuracy(cfg: DictConfig, target: Target) -> tuple[list[list[float]], int]:
    """(rank_accuracy, steps counted) of cfg.drafter on the first cfg.num_prompts held-out
    prompts, decoded greedily (cfg.max_new_tokens each) on the complete tree of
    cfg.measure_depth levels and cfg.measure_top_k children per node."""
    tree = complete_tree(cfg.measure_depth, cfg.measure_top_k)
    drafter = build_drafter(cfg.drafter, {"choices": [list(c) for c in tree.choices]}, target)
    tally = RankTally(GreedyRule(), cfg.measure_depth, cfg.measure_top_k)
    prompts = heldout_prompts(prompt_data(cfg), target, cfg.num_prompts)
    for ids in tqdm(prompts, desc=f"measuring rank accuracy ({tree.size - 1}-node tree)",
                    unit="prompt"):
        generate(target.step, ids, cfg.max_new_tokens, drafter=drafter, rule=tally,
                 eos_token_id=target.eos_token_ids)
    return tally.table(), tally.reached[0]
