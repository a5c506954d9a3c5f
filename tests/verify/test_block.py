"""Block verification (Sun et al. 2024) on chains: exact by enumeration, a wrong variant
caught by the same check, never fewer tokens accepted than token-level verification, and a
sampler that draws what `outcomes` says."""

import itertools
from collections import Counter

import pytest
import torch

from experiments.stats import chi_square_test
from tests.verify.tree_enumeration import continuations
from verify.accept import BlockVerificationRule, SpeculativeSamplingRule
from verify.rules import make_rule, rule_from_config
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeBatch

T1 = SamplingParams(1.0)


class UnweightedResidualRule(BlockVerificationRule):
    """Wrong on purpose: after a stop it draws from token-level verification's residual
    max(p - q, 0), forgetting the weight w of the prefix it keeps."""

    name = "block-unweighted (control)"
    exact = False

    def residual(self, weight, p, q):
        return (p - q).clamp_min(0)


Table = dict[tuple[int, ...], torch.Tensor]


def tables(seed: int, vocab: int, depth: int, close: bool) -> tuple[Table, Table]:
    """The target's p and the draft's q (float64), a conditional distribution per prefix of up
    to `depth` tokens: fixed random rows, one token without mass in each of p's. q is drawn
    independently of p (each without mass somewhere), or, `close`, as p's logits plus noise,
    a draft that often agrees."""
    generator = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            logits = 2 * torch.randn(vocab, generator=generator, dtype=torch.float64)
            logits[int(torch.randint(vocab, (), generator=generator))] = float("-inf")
            p[prefix] = logits.softmax(-1)
            noise = torch.randn(vocab, generator=generator, dtype=torch.float64)
            if not close:
                noise[int(torch.randint(vocab, (), generator=generator))] = float("-inf")
            q[prefix] = ((logits if close else 0) + 2 * noise).softmax(-1)
    return p, q


def flags(kind: str, length: int) -> list[bool]:
    """Which chain positions sample their token (the others take q's argmax)."""
    return {"sampled": [True] * length, "deterministic": [False] * length,
            "mixed": [i % 2 == 0 for i in range(length)]}[kind]


def drafts(q, vocab: int, length: int, kind: str):
    """Every draft chain a drafter of this kind proposes: (tokens, probability, flags)."""
    sampled = flags(kind, length)
    chains = [((), 1.0)]
    for i in range(length):
        grown = []
        for prefix, weight in chains:
            row = q[prefix]
            if sampled[i]:
                grown += [((*prefix, x), weight * float(row[x])) for x in range(vocab)
                          if row[x] > 0]
            else:
                grown.append(((*prefix, int(row.argmax())), weight))
        chains = grown
    return [(chain, weight, sampled) for chain, weight in chains]


def chain_tree(chain, q, sampled) -> TokenTree:
    """The chain as a drafter hands it over: every draft row recorded, the flags deciding
    which are draws (a deterministic position's row is there too, and must be ignored)."""
    rows = [q[chain[:i]] for i in range(len(chain))]
    vocab = len(q[()])
    return TokenTree(torch.tensor([0, *chain]), torch.arange(len(chain) + 1) - 1,
                     torch.stack([*rows, torch.zeros(vocab, dtype=torch.float64)]),
                     sampled=torch.tensor([*sampled, False]))


def target_rows(p, chain) -> torch.Tensor:
    return torch.stack([p[chain[:i]] for i in range(len(chain) + 1)])


def output_distribution(rule, p, q, vocab, length, kind) -> dict[tuple[int, ...], float]:
    """Exactly what one verification step emits, each outcome continued by the target to
    length + 1 tokens: the sum over drafts, accepted lengths and bonus tokens."""
    out: Counter = Counter()
    for chain, weight, sampled in drafts(q, vocab, length, kind):
        accept, bonus = rule.outcomes(chain_tree(chain, q, sampled), target_rows(p, chain))
        for k in range(length + 1):
            for y in range(vocab):
                mass = weight * float(accept[k]) * float(bonus[k, y])
                if mass > 0:
                    for seq, tail in continuations(p, (*chain[:k], y), length + 1):
                        out[seq] += mass * tail
    return out


def worst_error(rule, vocab, length, seed, close, kind) -> float:
    p, q = tables(seed, vocab, length, close)
    out = output_distribution(rule, p, q, vocab, length, kind)
    joint = dict(continuations(p, (), length + 1))
    return max(abs(out.get(seq, 0.0) - prob) for seq, prob in joint.items())


# (vocab, chain length, seed, q close to p)
CASES = [(3, 3, 0, False), (3, 3, 1, True), (4, 2, 2, False), (4, 2, 3, True)]


@pytest.mark.parametrize("kind", ["sampled", "deterministic", "mixed"])
@pytest.mark.parametrize("vocab, length, seed, close", CASES)
def test_block_verification_emits_the_target_joint_exactly(kind, vocab, length, seed, close):
    assert worst_error(BlockVerificationRule(), vocab, length, seed, close, kind) < 1e-6


@pytest.mark.parametrize("kind", ["sampled", "deterministic", "mixed"])
def test_the_unweighted_residual_is_caught_by_the_same_check(kind):
    errors = [worst_error(UnweightedResidualRule(), *case, kind) for case in CASES]
    assert min(errors) > 1e-3


def expected_lengths(seed, vocab, length, kind, close) -> tuple[float, float]:
    """(block, token-level) expected accepted draft tokens, exactly, over the drafts. A
    token-level chain keeps x_1..x_k with probability prod_{i <= k} min(1, p(x_i) / q(x_i)),
    q one-hot at deterministic positions (SpeculativeSamplingRule on a chain)."""
    p, q = tables(seed, vocab, length, close)
    block = token = 0.0
    for chain, weight, sampled in drafts(q, vocab, length, kind):
        accept, _ = BlockVerificationRule().outcomes(chain_tree(chain, q, sampled),
                                                     target_rows(p, chain))
        block += weight * float((torch.arange(length + 1) * accept).sum())
        survive = 1.0
        for i, token_i in enumerate(chain):
            q_i = float(q[chain[:i]][token_i]) if sampled[i] else 1.0
            survive *= min(1.0, float(p[chain[:i]][token_i]) / q_i)
            token += weight * survive
    return block, token


@pytest.mark.parametrize("kind", ["sampled", "deterministic", "mixed"])
def test_block_verification_never_accepts_fewer_tokens_than_token_level(kind):
    gains = []
    for seed in range(24):
        block, token = expected_lengths(seed, 3, 3, kind, close=seed % 3 > 0)
        assert block >= token - 1e-9, (seed, block, token)
        gains.append(block - token)
    if kind == "deterministic":
        # one fixed draft: no exact rule keeps x_1..x_k more often than the target writes
        # it, prod p(x_i), which token-level verification already does
        assert max(gains) < 1e-9
    else:
        assert max(gains) > 0.01  # and it does accept more somewhere


def test_the_token_level_length_is_what_the_sampling_rule_accepts():
    # the closed form the comparison above uses, against SpeculativeSamplingRule itself
    p, q = tables(0, 3, 3, close=True)
    chain, _, sampled = max(drafts(q, 3, 3, "sampled"), key=lambda d: d[1])
    tree, logits = chain_tree(chain, q, sampled), target_rows(p, chain).log().float()
    survive, expected = 1.0, 0.0
    for i, token in enumerate(chain):
        survive *= min(1.0, float(p[chain[:i]][token] / q[chain[:i]][token]))
        expected += survive
    generator = torch.Generator().manual_seed(0)
    runs = [SpeculativeSamplingRule()(tree, logits, T1, generator).num_accepted
            for _ in range(3000)]
    assert sum(runs) / len(runs) == pytest.approx(expected, abs=0.06)


def test_the_rule_draws_the_outcomes_it_computes():
    p, q = tables(1, 4, 3, close=True)
    chain, _, sampled = max(drafts(q, 4, 3, "sampled"), key=lambda d: d[1])
    tree, probs = chain_tree(chain, q, sampled), target_rows(p, chain)
    accept, bonus = BlockVerificationRule().outcomes(tree, probs)
    expected = {(k, y): float(accept[k] * bonus[k, y]) for k in range(4) for y in range(4)}
    generator, rule = torch.Generator().manual_seed(0), make_rule("block", T1)
    counts: Counter = Counter()
    for _ in range(4000):
        a = rule(tree, probs.log().float(), T1, generator)
        assert a.path == list(range(len(a.path)))
        counts[(a.num_accepted, a.bonus)] += 1
    assert chi_square_test(counts, expected)[1] > 1e-3
    assert len({k for k, _ in counts}) >= 3  # several lengths were drawn, not only one


def test_block_is_registered_and_refuses_a_tree_naming_the_sampling_rule():
    assert isinstance(rule_from_config("block", T1), BlockVerificationRule)
    assert BlockVerificationRule.exact and BlockVerificationRule.chains_only
    tree = TokenTree(torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="chains only.*node 0 has 2 children.*'sampling'"):
        BlockVerificationRule()(tree, torch.zeros(3, 4), T1)


def test_a_root_alone_and_the_batched_default():
    rule, generator = BlockVerificationRule(), torch.Generator().manual_seed(0)
    root = TokenTree(torch.tensor([3]), torch.tensor([-1]))
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0]])
    assert rule(root, logits, T1, generator).path == [0]
    chain = TokenTree(torch.tensor([3, 2, 1]), torch.tensor([-1, 0, 1]))
    trees = [root, chain]
    sure = torch.full((2, 3, 4), -30.0)
    sure[:, :, 2] = 30.0  # the target is sure of token 2 everywhere
    batch = rule.accept_batch(trees, TreeBatch.pad(trees), sure, T1, generator)
    assert [a.path for a in batch] == [[0], [0, 1]] and [a.bonus for a in batch] == [2, 2]


def test_greedy_block_verification_is_greedy():
    chain = TokenTree(torch.tensor([3, 2, 1]), torch.tensor([-1, 0, 1]))
    logits = torch.zeros(3, 4)
    logits[0, 2] = logits[1, 1] = logits[2, 0] = 5.0  # argmax 2, 1, then 0
    a = make_rule("block", SamplingParams())(chain, logits, SamplingParams())
    assert a.path == [0, 1, 2] and a.bonus == 0
