"""Prompt lookup: hand-worked trees, the match order, partial trees, depth limit and speed."""

import time

import pytest
import torch

from drafters.prompt_lookup import PromptLookupDrafter
from verify.protocol import DraftContext
from verify.sampling import SamplingParams
from verify.tree import TreeError, TreeTopology


def propose(drafter, tokens):
    return drafter.propose(DraftContext(torch.tensor(tokens), None, SamplingParams()))


def test_fills_the_topology_from_matches_hand_worked(topology):
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 8, 3, 6, 7, 2, 3]
    # "7 2 3" never occurred before. "2 3" did at 1 and 5: continuations from 7 (recent) and 3.
    # "3" did at 2, 6, 9: only the one at 9 (continuation from 10) is new (with unigrams on).
    drafter = PromptLookupDrafter(topology("tree8"), min_ngram=1)
    assert drafter.candidates(torch.tensor(tokens)) == [7, 3, 10]
    tree = propose(drafter, tokens)
    # tree8: [0] [1] [2] [0,0] [0,1] [1,0] [0,0,0] [0,0,0,0]. Level 1: 5, 4, 6 (first tokens
    # of continuations 7, 3, 10). Under 5 only continuation 7 agrees: 8, then 3, then 6; no
    # second token under 5, so [0,1] is dropped. Under 4 (continuation 3): 9.
    assert tree.tokens.tolist() == [3, 5, 4, 6, 8, 9, 3, 6]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 2, 4, 6]
    assert tree.draft_probs is None


def test_longer_matches_rank_before_more_recent_shorter_ones():
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 3, 4, 1, 2, 3]
    drafter = PromptLookupDrafter(TreeTopology.from_choices([[0], [1], [2]]), min_ngram=1)
    tree = propose(drafter, tokens)
    assert tree.tokens.tolist() == [3, 9, 8, 4]  # "1 2 3" -> 9, then "2 3" -> 8, then "3" -> 4


def test_siblings_are_the_distinct_next_tokens_of_agreeing_matches():
    tokens = [7, 1, 2, 7, 1, 5, 7, 1, 2, 7, 1, 6, 7]
    drafter = PromptLookupDrafter(TreeTopology.from_choices([[0], [0, 0], [0, 1], [0, 2]]),
                                  max_ngram=1, min_ngram=1)
    tree = propose(drafter, tokens)
    # Every "7" is followed by 1; after "7 1" the continuations say 6, 2, 5, 2 (recent first).
    assert tree.tokens.tolist() == [7, 1, 6, 2, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 1]


def test_min_ngram_limits_the_search():
    drafter = PromptLookupDrafter(TreeTopology.chain(2), max_ngram=3, min_ngram=2)
    assert len(propose(drafter, [4, 5, 6, 1, 2, 6])) == 1  # only the unigram "6" recurs
    assert propose(drafter, [4, 5, 6, 1, 5, 6]).tokens.tolist() == [6, 1, 5]


@pytest.mark.parametrize("tokens", [[3], [1, 2, 3, 4, 5]])
def test_no_match_gives_the_root_alone(tokens, topology):
    tree = propose(PromptLookupDrafter(topology("tree16")), tokens)
    assert tree.tokens.tolist() == [tokens[-1]] and tree.parents.tolist() == [-1]


def test_a_tree_deeper_than_max_depth_is_refused():
    PromptLookupDrafter(TreeTopology.chain(8))
    with pytest.raises(TreeError, match="depth 9 exceeds what prompt_lookup can fill"):
        PromptLookupDrafter(TreeTopology.chain(9))
    with pytest.raises(TreeError, match="at most 4"):
        PromptLookupDrafter(TreeTopology.chain(5), max_depth=4)


def test_bad_ngram_bounds_are_refused():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookupDrafter(TreeTopology.chain(2), max_ngram=2, min_ngram=3)


def test_fast_on_long_repetitive_contexts(topology):
    # Every step runs this: a 2k-token context over 3 token ids gives ~700 candidates.
    tokens = torch.randint(0, 3, (2000,), generator=torch.Generator().manual_seed(0))
    drafter = PromptLookupDrafter(topology("tree16"))
    start = time.perf_counter()
    for _ in range(10):
        tree = drafter.propose(DraftContext(tokens, None, SamplingParams()))
    assert (time.perf_counter() - start) / 10 < 0.05
    assert len(tree) > 10
