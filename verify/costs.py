"""The target's measured step cost t(n): one verification step of n tree tokens, timed.

Every cost-aware choice reads it: tree_search's offline budget, the per-step adaptive tree
(drafters.trees.cost), the speed model (experiments.simulate), the context sweep and the profile.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from verify.runtime.files import read_json
from verify.runtime.model import context_window
from verify.runtime.step import TargetStep
from verify.runtime.timing import device_clock
from verify.tree import TokenTree, TreeTopology
from verify.verifier import TreeVerifier


@torch.no_grad()
def measure_verify_cost(step: TargetStep | PreTrainedModel, sizes: Sequence[int],
                        context_len: int = 256, repeats: int = 5,
                        draft_cost_s: float = 0.0, interleave: bool = True
                        ) -> dict[int, float]:
    """{n: median seconds of one TreeVerifier step verifying n tokens, the root included}, on
    the target's step (`Target.step`) or a bare model's eager one.

    The tokens form a chain (one shape is enough: the step's cost depends on n, not on where
    the branches are) after `context_len` cached tokens drawn from the global RNG. n = 1 is a
    plain decoding step; draft_cost_s is added to every n > 1, where a drafter has to run.
    interleave: sizes take turns, so every step follows one of another size, as in decoding
    whose trees vary (a step that re-prepares for a new shape pays it: OpenVINO's dynamic
    graphs); False: each size's steps back to back, the cost at a fixed size.
    """
    if not sizes or min(sizes) < 1 or repeats < 1:
        raise ValueError(f"need token counts >= 1 and repeats >= 1, got sizes {list(sizes)}, "
                         f"repeats {repeats}")
    verifier = TreeVerifier(step)
    model = verifier.model
    window = context_window(model)
    if window is not None and context_len + max(sizes) > window:
        raise ValueError(f"context_len {context_len} + {max(sizes)} tokens exceed the model's "
                         f"{window} positions")
    vocab = model.config.vocab_size
    verifier.prefill(torch.randint(vocab, (context_len,)))
    trees = {n: TokenTree.from_choices(0, TreeTopology.chain(n - 1),
                                       [i % vocab for i in range(1, n)])
             for n in sorted(set(sizes))}
    times: dict[int, list[float]] = {n: [] for n in trees}
    # Interleaved, sizes take turns, so machine noise (other processes, clock changes) hits
    # all alike; the first round pays one-off costs (allocations, kernel selection).
    rounds = [(i, n) for i in range(repeats + 1) for n in trees] if interleave else \
        [(i, n) for n in trees for i in range(repeats + 1)]
    for i, n in rounds:
        seconds = time_step(verifier, trees[n])
        if i:
            times[n].append(seconds)
    return {n: statistics.median(t) + (draft_cost_s if n > 1 else 0.0) for n, t in times.items()}


def time_step(verifier: TreeVerifier, tree: TokenTree) -> float:
    """Seconds of one `verifier.verify(tree)`; the verifier's cache is left as it was."""
    clock = device_clock(verifier.model.device)  # an accelerator's queued work included
    start = clock()
    verifier.verify(tree)
    seconds = clock() - start
    # Keeping no node drops the tree's keys/values: every step sees the same context.
    verifier.commit([])
    return seconds


def load_costs(path: str | Path) -> dict[int, float]:
    """{n: seconds} from an experiments.tree_search JSON (rows with n and t_s)."""
    rows = read_json(path, "costs").get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"n", "t_s"} <= set(r)
                                             for r in rows):
        raise ValueError(f"{path} holds no experiments.tree_search rows (n, t_s)")
    cost = {int(r["n"]): float(r["t_s"]) for r in rows}
    if 1 not in cost:
        raise ValueError(f"{path} has no t(1), the plain step every speedup divides by")
    return cost
