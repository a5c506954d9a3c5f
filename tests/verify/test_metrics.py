"""tau and acceptance by depth, pooled over steps, on hand-counted steps."""

import pytest
import torch

from verify.loop import GenerationResult, StepStats
from verify.metrics import (
    TokensPerForward,
    acceptance_by_depth,
    accepted_histogram,
    step_tokens,
    tau,
)


def result(*accepted: int) -> GenerationResult:
    steps = [StepStats(a, tree_size=4, tree_depth=3, draft_s=0.0, verify_s=0.0)
             for a in accepted]
    return GenerationResult(torch.zeros(sum(accepted) + len(accepted), dtype=torch.long), steps)


def test_tau_counts_the_bonus_token_of_every_step():
    assert step_tokens([0, 2, 3]) == [1, 3, 4]
    assert tau([0, 2, 3]) == pytest.approx(8 / 3)
    assert tau([]) == 0.0 and TokensPerForward().tau == 0.0


def test_tallies_pool_steps_not_prompts():
    short, long = result(3), result(0, 0, 0, 0)  # taus 4.0 and 1.0
    pooled = short.tally + long.tally
    assert (pooled.tokens, pooled.forwards) == (8, 5)
    assert pooled.tau == pytest.approx(8 / 5)  # the mean of the prompts' taus would say 2.5
    assert short.tau == 4.0 and long.tau == 1.0


def test_acceptance_by_depth_counts_only_the_steps_that_tried_a_depth():
    # accepted 0, 2, 3, 1, 3 on depth-3 trees: depth 1 tried by 5, depth 2 by 4, depth 3 by 3
    assert acceptance_by_depth([0, 2, 3, 1, 3], [3] * 5) == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    # a depth-1 tree never tries depth 2; a depth no step tried has no rate
    assert acceptance_by_depth([1, 0], [1, 3]) == [0.5, None, None]
    with pytest.raises(ValueError, match="2 accepted counts for 1 tree depths"):
        acceptance_by_depth([1, 0], [1])


def test_accepted_histogram_shares():
    assert accepted_histogram([0, 2, 3, 1, 3]) == pytest.approx([0.2, 0.2, 0.2, 0.4])
    assert accepted_histogram([]) == []
