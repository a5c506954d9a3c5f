"""EAGLE-2's tree (`total_tokens`, and `depth` and `top_k` when several are given) from
measured decoding and verification cost.

A dynamic tree has no accuracy table to predict its acceptance from: what a budget buys is
measured by decoding held-out training prompts greedily with the drafter on
DynamicTree(depth, top_k, total_tokens=budget), for every tree shape (depth, top_k) asked. With
tau the tokens per target forward, t(n) the measured time of verifying n tokens and d the draft
time per step, a tree is predicted to run at tau / (t(budget + 1) + d) tokens/s; plain decoding
runs at 1 / t(1). `experiments.tree_search mode=dynamic` puts the pieces here together.
"""

from __future__ import annotations

import platform
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from drafters import build_drafter
from drafters.trees.dynamic import DynamicTree
from experiments.common import CONF_DIR
from experiments.table import markdown_table
from train.distill import encode_until
from train.prompts import interleave, load_prompt_files
from train.schema import DataConfig
from verify.loop import GenerationResult, generate
from verify.protocol import Drafter
from verify.runtime.files import write_text
from verify.runtime.model import Target, target_name
from verify.tree import TreeError


@dataclass(frozen=True)
class BudgetCost:
    """One tree's measurements: tau (tokens per target forward, bonus included), verify_s
    = t(budget + 1), draft_s, the mean drafting seconds per step, and loop_s, the loop's own
    seconds per step around them; depth and top_k are the tree's shape (0 for plain
    decoding)."""

    budget: int
    tau: float
    verify_s: float
    draft_s: float
    depth: int = 0
    top_k: int = 0
    loop_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tau / (self.verify_s + self.draft_s + self.loop_s)


def best_cost(costs: Sequence[BudgetCost]) -> BudgetCost:
    """The tree with the most predicted tokens/s; ties go to the smaller budget, then the
    shallower and narrower shape (the cheaper to draft)."""
    if not costs:
        raise ValueError("no budget measured")
    return max(sorted(costs, key=lambda c: (c.budget, c.depth, c.top_k)),
               key=lambda c: c.tokens_per_s)


def tree_shapes(depth: int | Sequence[int], top_k: int | Sequence[int]) -> list[tuple[int, int]]:
    """Every (depth, top_k) pair of the values given (an integer or a list of them each)."""
    def values(name: str, given: int | Sequence[int]) -> list[int]:
        listed = [given] if isinstance(given, int) else list(given)
        if not listed:
            raise ValueError(f"{name} must be an integer or a non-empty list of them")
        return sorted(set(listed))

    return [(d, k) for d in values("depth", depth) for k in values("top_k", top_k)]


def candidate_count(depth: int, top_k: int) -> int:
    """How many candidates `depth` rounds of `top_k` children per frontier node propose."""
    DynamicTree(depth, top_k, 1)  # refuses a depth or top_k below 1
    return top_k + (depth - 1) * top_k * top_k


def check_budgets(budgets: Sequence[int], depth: int, top_k: int) -> list[int]:
    """The distinct budgets, ascending; each must be an integer from 1 to the number of
    candidates `depth` rounds of `top_k` can propose (more would verify a smaller tree than
    the t(budget + 1) it is charged)."""
    candidates = candidate_count(depth, top_k)
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                          for b in budgets):
        raise ValueError(f"budgets must be a non-empty list of integers >= 1 (draft nodes per "
                         f"step, root not counted), got {list(budgets)}")
    if max(budgets) > candidates:
        raise ValueError(f"budget {max(budgets)} exceeds the {candidates} candidates depth "
                         f"{depth} and top_k {top_k} propose")
    return sorted(set(budgets))


def candidate_trees(budgets: Sequence[int], shapes: Sequence[tuple[int, int]]
                    ) -> dict[DynamicTree, list[tuple[int, int]]]:
    """The distinct trees to measure, each with the (depth, top_k) shapes asked that it stands
    for: each budget on each shape that can fill it.

    A budget of b grows at most b rounds (DynamicTree.search_steps), so a deeper shape is the
    same tree as depth b and is measured once. A budget no shape can fill is refused; one that
    only some shapes fill is skipped for the others, and said so."""
    widest = max(shapes, key=lambda shape: candidate_count(*shape))
    trees: dict[DynamicTree, list[tuple[int, int]]] = {}
    for budget in check_budgets(budgets, *widest):
        fits = [(d, k) for d, k in shapes if budget <= candidate_count(d, k)]
        if len(fits) < len(shapes):
            print(f"budget {budget}: skipped for (depth, top_k) "
                  f"{sorted(set(shapes) - set(fits))}, which propose fewer candidates")
        for d, k in fits:
            trees.setdefault(DynamicTree(min(d, budget), k, budget), []).append((d, k))
    return trees


def tree_drafters(drafter_cfg: Mapping, trees: Sequence[DynamicTree], target: Target,
                  seed: int) -> dict[DynamicTree, Drafter]:
    """{tree: the configured drafter growing it}.

    Raises TreeError for a drafter that cannot grow dynamic trees.
    """
    drafters = {}
    for tree in trees:
        # The same seed for each build: a fresh (untrained) draft is the same draft for every
        # tree, so the trees alone differ.
        torch.manual_seed(seed)
        policy = {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens}
        try:
            drafters[tree] = build_drafter(drafter_cfg, policy, target)
        except TreeError as e:
            raise TreeError(f"mode=dynamic measures EAGLE-2 dynamic trees, which drafter="
                            f"{drafter_cfg['name']} cannot grow (use eagle, eagle3 or "
                            f"draft_model): {e}") from e
    return drafters


def prompt_data(cfg: DictConfig) -> DictConfig:
    """The data whose held-out prompts mode=dynamic decodes: `data` (by default the drafter's
    own training data); for a drafter with nothing to train, and so no data of its own (suffix,
    hybrid), self-distillation's: no run here trains on its held-out prompts."""
    if cfg.get("data") is not None:
        return cfg.data
    return OmegaConf.merge(OmegaConf.structured(DataConfig),
                           OmegaConf.load(Path(CONF_DIR) / "data" / "self_distill.yaml"))


def heldout_prompts(data: DictConfig, target: Target, count: int) -> list[torch.Tensor]:
    """The first `count` (P,) prompts every training run on `data` holds out: the interleaved
    training prompts that fit data.max_prompt_tokens, in train.distill.distilled_data's order.
    Spec-Bench is the evaluation set, so tuning never sees it."""
    if not 1 <= count <= data.heldout_prompts:
        raise ValueError(f"num_prompts must be from 1 to data.heldout_prompts "
                         f"({data.heldout_prompts}): later prompts are trained on, got {count}")
    texts = interleave(load_prompt_files(data.root, list(data.sources)), data.seed)
    return encode_until(target, texts, count, data.max_prompt_tokens)


def decode_trees(target: Target, drafters: Mapping[DynamicTree, Drafter],
                 prompts: list[torch.Tensor], max_new_tokens: int
                 ) -> dict[DynamicTree, GenerationResult]:
    """{tree: every prompt's greedy decoding merged (tokens concatenated, steps in order)}."""
    results: dict[DynamicTree, list[GenerationResult]] = {tree: [] for tree in drafters}
    for ids in tqdm(prompts, desc=f"decoding {len(drafters)} trees", unit="prompt"):
        # Trees take turns on each prompt, so machine noise hits all alike.
        for tree, drafter in drafters.items():
            results[tree].append(generate(target.step, ids, max_new_tokens, drafter=drafter,
                                          eos_token_id=target.eos_token_ids))
    return {tree: GenerationResult(torch.cat([r.tokens for r in rs]),
                                   [s for r in rs for s in r.steps],
                                   sum(r.prefill_s for r in rs),
                                   decode_s=sum(r.decode_s for r in rs))
            for tree, rs in results.items()}


def budget_rows(cost: Mapping[int, float], results: Mapping[DynamicTree, GenerationResult],
                stands_for: Mapping[DynamicTree, list[tuple[int, int]]] | None = None
                ) -> list[dict]:
    """The table behind the choice: plain decoding (total_tokens 0, n 1), then one row per
    tree (shape and budget) with its measured t(budget + 1), draft and loop seconds per step
    (the loop's own time, measured in the same decoding), tau, mean tree size (root included),
    predicted tokens/s and predicted speedup over plain decoding, the tokens/s its decoding
    itself ran at (prefill excluded: what the prediction models), and the (depth, top_k)
    shapes asked that the tree stands for (`stands_for`; the plot draws one line per shape
    asked). Plain decoding's own loop time is not measured here (0.1 ms a step on the
    OpenVINO step: docs/results/step-cost.md), so its row charges t(1) alone."""
    trees = sorted(results, key=lambda t: (t.total_tokens, t.depth, t.top_k))
    costs = {tree: _budget_cost(tree, cost[tree.total_tokens + 1], results[tree])
             for tree in trees}
    chosen = best_cost(list(costs.values()))
    plain = BudgetCost(0, 1.0, cost[1], 0.0)

    def row(c: BudgetCost, shapes: list[list[int]] | None, result: GenerationResult | None
            ) -> dict:
        decoded = None if result is None or not result.decode_s else \
            len(result.tokens) / result.decode_s
        return {"depth": c.depth or None, "top_k": c.top_k or None, "shapes": shapes,
                "total_tokens": c.budget, "n": c.budget + 1, "t_s": c.verify_s,
                "draft_s_per_step": c.draft_s, "loop_s_per_step": c.loop_s, "tau": c.tau,
                "mean_tree_size": 1.0 if result is None else _mean_tree_size(result),
                "predicted_tokens_per_s": c.tokens_per_s,
                "predicted_speedup": c.tokens_per_s * plain.verify_s,
                "decoded_tokens_per_s": decoded, "chosen": c == chosen}

    asked = stands_for or {}
    return [row(plain, None, None)] + [  # plain decoding: the root alone, no shape
        row(costs[tree], [list(shape) for shape in asked.get(tree, [(tree.depth, tree.top_k)])],
            results[tree])
        for tree in trees]


def _budget_cost(tree: DynamicTree, verify_s: float, result: GenerationResult) -> BudgetCost:
    """A tree's costs per step: t(n) as timed alone, drafting and the loop's own time as its
    decoding measured them."""
    steps = max(len(result.steps), 1)
    return BudgetCost(tree.total_tokens, result.tau, verify_s, result.draft_s / steps,
                      tree.depth, tree.top_k, result.loop_s / steps)


def _mean_tree_size(result: GenerationResult) -> float:
    # Below the budget + 1 charged when the draft has too few finite candidates.
    return sum(s.tree_size for s in result.steps) / max(len(result.steps), 1)


def format_budget_table(rows: list[dict]) -> str:
    """Markdown, one line per row of budget_rows."""
    lines = []
    for r in rows:
        note = "plain decoding" if r["total_tokens"] == 0 else ("**chosen**" if r["chosen"]
                                                                  else "")
        # rows saved before shapes were recorded have no depth or top_k
        # rows saved before the loop's time was measured have neither of its figures
        loop, decoded = r.get("loop_s_per_step"), r.get("decoded_tokens_per_s")
        lines.append([r.get("depth"), r.get("top_k"), r["total_tokens"],
                      f"{1000 * r['t_s']:.1f}", f"{1000 * r['draft_s_per_step']:.1f}",
                      "-" if loop is None else f"{1000 * loop:.2f}",
                      f"{r['tau']:.3f}", f"{r['mean_tree_size']:.1f}",
                      f"{r['predicted_tokens_per_s']:.1f}", f"{r['predicted_speedup']:.2f}x",
                      "-" if decoded is None else f"{decoded:.1f}", note])
    return markdown_table(["depth", "top_k", "total_tokens", "t(n) ms", "draft ms/step",
                           "loop ms/step", "tau", "mean nodes", "predicted tokens/s",
                           "predicted speedup", "decoded tokens/s", ""], lines)


def describe_machine(model: torch.nn.Module) -> str:
    """Where the timings were taken: the model's dtype and device (a GPU's name, or the CPU's
    architecture and torch's thread count)."""
    param = next(model.parameters())
    if param.device.type == "cuda":
        where = torch.cuda.get_device_name(param.device)
    else:
        where = (f"{param.device.type} {platform.processor() or platform.machine()}, "
                 f"threads={torch.get_num_threads()}")
    return f"{str(param.dtype).removeprefix('torch.')}, {where}"


def write_dynamic_tree_config(tree: DynamicTree, path: str | Path, name: str,
                              comment: str) -> None:
    """Write `tree` as a conf/tree YAML (name, depth, top_k, total_tokens) under `comment`,
    wrapped into YAML comment lines; atomically (a half-written file in conf/tree would break
    every command using the group)."""
    # Paths (a checkpoint's) stay whole on one line.
    lines = textwrap.wrap(comment, width=98, break_long_words=False, break_on_hyphens=False)
    header = "\n".join(f"# {line}" for line in lines)
    write_text(Path(path), f"{header}\nname: {name}\ndepth: {tree.depth}\n"
                           f"top_k: {tree.top_k}\ntotal_tokens: {tree.total_tokens}\n")


def measurement_note(cfg: DictConfig, machine: str, rows: list[dict]) -> str:
    """What the chosen budget was measured on and what it predicts, for the YAML's header."""
    plain, best = rows[0], next(r for r in rows if r["chosen"])
    checkpoint = cfg.drafter.get("checkpoint") or cfg.drafter.get("path")
    weights = f"weights {checkpoint}" if checkpoint else "fresh, untrained weights"
    trees = sorted({(r["depth"], r["top_k"], r["total_tokens"]) for r in rows[1:]})
    name = target_name(cfg.target.path, cfg.target.tiny)  # what loaded, not conf's `name`
    return (f"Measured by experiments.tree_search mode=dynamic on {name} ({machine}): "
            f"trees (depth, top_k, total_tokens) {trees} decoded greedily by drafter "
            f"{cfg.drafter.name} ({weights}) on "
            f"{cfg.num_prompts} held-out training prompts x {cfg.max_new_tokens} tokens. "
            f"Predicted {best['predicted_speedup']:.2f}x plain decoding "
            f"({best['predicted_tokens_per_s']:.1f} tokens/s; its decoding ran at "
            f"{best['decoded_tokens_per_s']:.1f}, prefill excluded): tau {best['tau']:.2f}, "
            f"t({best['n']}) {1000 * best['t_s']:.1f} ms, draft "
            f"{1000 * best['draft_s_per_step']:.1f} ms/step, loop "
            f"{1000 * best['loop_s_per_step']:.2f} ms/step, t(1) {1000 * plain['t_s']:.1f} ms.")
