"""Per-step tree sizes from the machine's measured cost (Sequoia's idea, applied every step).

A tree of n tokens (root included) costs t(n) to verify; its draft nodes are worth their
scores, each an estimate that the node's whole path is accepted, so the step is expected to
yield 1 + (sum of kept scores) tokens (the bonus token included). Speed is tokens per second,
so each step keeps the k best nodes that maximise

    (1 + s_1 + ... + s_k) / (t(k + 1) + draft seconds)

A node is worth keeping when its score exceeds the extra verification cost times the step's
current rate. This is the issue's "expected tokens it adds, times t(1), exceed t(n + 1) - t(n)"
with the rate of the tree kept so far in place of plain decoding's 1 / t(1). The argmax over
every k (not a stop at the first node that does not pay) is deliberate: measured t(n) is not
convex here (t(2) > t(4) on one run), and a marginal rule would stop at such a bump.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from verify.costs import load_costs, measure_verify_cost
from verify.runtime.model import context_window
from verify.runtime.step import TargetStep, as_step
from verify.tree import TokenTree, TreeError


@dataclass(frozen=True, eq=False)  # t_ms is a dict: hashed by identity
class StepCost:
    """t_ms: {n: ms of one target step verifying n tokens, the root included}, t(1) given;
    draft_ms: ms of one draft forward (0 for a model-free drafter)."""

    t_ms: Mapping[int, float]
    draft_ms: float = 0.0

    def __post_init__(self) -> None:
        if 1 not in self.t_ms or any(n < 1 or t <= 0 for n, t in self.t_ms.items()):
            raise ValueError(f"t_ms must map token counts n >= 1, t(1) among them, to positive "
                             f"milliseconds; got {dict(self.t_ms)}")
        if self.draft_ms < 0:
            raise ValueError(f"draft_ms must be >= 0, got {self.draft_ms}")

    def t(self, n: int) -> float:
        """ms to verify n tokens: measured, or linear between the nearest measured sizes
        (past the largest, the slope of the last two; a flat t(1) alone past it)."""
        sizes = sorted(self.t_ms)
        if n in self.t_ms:
            return float(self.t_ms[n])
        below = [m for m in sizes if m < n]
        above = [m for m in sizes if m > n]
        if above:
            lo, hi = below[-1], above[0]
        elif len(sizes) > 1:
            lo, hi = sizes[-2], sizes[-1]
        else:
            return float(self.t_ms[1])
        slope = (self.t_ms[hi] - self.t_ms[lo]) / (hi - lo)
        return float(self.t_ms[lo] + slope * (n - lo))

    @staticmethod
    def from_file(path: str | Path, draft_ms: float = 0.0) -> StepCost:
        """t(n) from an experiments.tree_search JSON of this machine (verify.costs.load_costs)."""
        return StepCost({n: seconds * 1e3 for n, seconds in load_costs(path).items()}, draft_ms)


MEASURED_SIZES = (1, 2, 4, 8, 16, 32)


def measured_cost(tree_cfg: Mapping, step: TargetStep | PreTrainedModel) -> Mapping:
    """`tree_cfg` with a `cost: {measure: true}` replaced by t_ms measured on `step` now (the
    target's step, or a bare model's eager one; sizes MEASURED_SIZES after a 256-token
    context, or the window's end); as it was otherwise.
    Measuring takes a few seconds, once per drafter built."""
    cost = tree_cfg.get("cost") or {}
    if not cost or not _measures(cost):
        return tree_cfg
    step = as_step(step)
    seconds = measure_verify_cost(step, MEASURED_SIZES, context_len=_context(step.model),
                                  repeats=3)
    t_ms = {n: s * 1e3 for n, s in seconds.items()}
    print("measured t(n), ms: " + ", ".join(f"t({n}) {t:.1f}" for n, t in t_ms.items()))
    resolved = {k: v for k, v in dict(cost).items() if k != "measure"}
    return {**tree_cfg, "cost": {**resolved, "t_ms": t_ms}}


def _context(model: PreTrainedModel) -> int:
    window = context_window(model)
    return 256 if window is None else max(1, min(256, window - max(MEASURED_SIZES)))


def step_cost(cfg: Mapping | None) -> StepCost | None:
    """A StepCost from a tree config's `cost` mapping: `t_ms` ({n: ms}) or `file` (a saved
    tree_search JSON), and `draft_ms`; None when the config has no cost (`measure`
    is resolved first by `measured_cost`). ValueError naming the key of a malformed value."""
    if not cfg:
        return None
    draft_ms = _milliseconds(cfg.get("draft_ms") or 0.0, "tree.cost.draft_ms", zero_allowed=True)
    if _measures(cfg):
        raise ValueError("tree.cost.measure needs the target to time: resolve it with "
                         "measured_cost(tree_cfg, model) first (drafters.build_drafter does)")
    if cfg.get("t_ms") is not None:
        return StepCost(_t_ms_table(cfg["t_ms"]), draft_ms)
    if cfg.get("file") is not None:
        return StepCost.from_file(cfg["file"], draft_ms)
    raise ValueError(f"tree cost {dict(cfg)} needs t_ms ({{n: ms}}), file (a tree_search "
                     "JSON of this machine) or measure: true")


# Where a cost can come from besides measuring it.
GIVEN_COSTS = ("t_ms", "file")


def _measures(cost: Mapping) -> bool:
    """Whether `cost` asks to time the target: `measure: true`, or `measure` unset (null)
    with neither t_ms nor file given. ValueError naming the keys that conflict: a measurement
    would replace a given cost, and two given costs cannot both be used."""
    measure = cost.get("measure")
    if measure is not None and not isinstance(measure, bool):
        raise ValueError(f"tree.cost.measure must be true, false or null, got {measure!r}")
    given = [key for key in GIVEN_COSTS if cost.get(key) is not None]
    if len(given) > 1:
        raise ValueError("tree.cost.t_ms and tree.cost.file are both given: keep one")
    if measure and given:
        raise ValueError(f"tree.cost.measure=true would replace the given tree.cost.{given[0]}: "
                         f"drop one of them (measure: null uses a given cost, else measures)")
    return measure is True or (measure is None and not given)


def _t_ms_table(t_ms: object) -> dict[int, float]:
    """{n: ms} from a config's `t_ms`; ValueError naming the entry that is not a token count
    n >= 1 mapped to a positive number of milliseconds."""
    if not isinstance(t_ms, Mapping):
        raise ValueError(f"tree.cost.t_ms must map token counts to milliseconds, e.g. "
                         f"{{1: 10, 8: 12}}; got {type(t_ms).__name__} {t_ms!r}")
    table = {}
    for n, t in t_ms.items():
        if isinstance(n, bool) or not str(n).isdigit() or int(n) < 1:
            raise ValueError(f"tree.cost.t_ms: key {n!r} is not a token count n >= 1")
        table[int(n)] = _milliseconds(t, f"tree.cost.t_ms[{n}]")
    return table


def _milliseconds(value: object, key: str, zero_allowed: bool = False) -> float:
    """`value` as milliseconds: a number above 0 (or 0 itself, where `zero_allowed`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number of milliseconds, got {value!r}")
    if value < 0 or (value == 0 and not zero_allowed):
        raise ValueError(f"{key} must be {'>= 0' if zero_allowed else '> 0'} ms, got {value}")
    return float(value)


def best_size(scores: Sequence[float], cost: StepCost, draft_forwards: int = 0) -> int:
    """How many of the nodes with `scores` (best first) to verify: the k maximising expected
    tokens per ms; 0 means decode plainly. Ties go to the smaller tree."""
    spent = draft_forwards * cost.draft_ms
    tokens, best, best_rate = 1.0, 0, 1.0 / (cost.t(1) + spent)
    for k, score in enumerate(scores, start=1):
        tokens += float(score)
        rate = tokens / (cost.t(k + 1) + spent)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def cut_to_cost(tree: TokenTree, cost: StepCost, draft_forwards: int = 0) -> TokenTree:
    """`tree` cut to the best-paying nodes by its scores (best first, parents before children).
    A tree without scores is refused: its nodes' worth is unknown."""
    if tree.scores is None:
        raise TreeError("a cost-sized tree needs node scores; this drafter gives none")
    order = ranked_nodes(tree.scores)
    keep = best_size(tree.scores[order].tolist(), cost, draft_forwards)
    return tree.keep(sorted([0, *order[:keep]]))


def ranked_nodes(scores: torch.Tensor) -> list[int]:
    """Node ids 1..N-1 by score, best first (ties: lower id, so a parent before a child that
    ties it); a node comes after its parent whenever scores never rise along a path."""
    order = scores[1:].double().sort(descending=True, stable=True).indices + 1
    return order.tolist()
