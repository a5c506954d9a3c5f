"""Statistics for the correctness evaluation: exact sequence distributions and chi-square."""

from __future__ import annotations

import torch
from scipy.stats import chi2

from verify.sampling import SamplingParams, warp


@torch.no_grad()
def sequence_distribution(model, prompt: torch.Tensor, length: int,
                          params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `length` tokens under the warped target.

    Enumerates all V^length continuations level by level (one batched forward per level), so
    it is meant for tiny vocabularies.
    """
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        prefixes = [p for p, mass in probs.items() if mass > 0]
        batch = torch.stack([torch.cat([prompt, torch.tensor(p, dtype=torch.long)])
                             for p in prefixes])  # (B, T + level)
        next_probs = warp(model(batch).logits[:, -1], params)  # (B, V)
        probs = {p + (t,): probs[p] * float(next_probs[i, t])
                 for i, p in enumerate(prefixes) for t in range(next_probs.shape[1])}
    return probs


def chi_square_test(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float],
                    min_expected: float = 5.0) -> tuple[float, float, int]:
    """Goodness of fit of observed sequence counts to exact probabilities.

    Cells expected to hold fewer than `min_expected` samples are pooled into one cell so the
    chi-square approximation holds. Returns (statistic, p-value, degrees of freedom).
    """
    total = sum(counts.values())
    observed_small, expected_small, stat, cells = 0, 0.0, 0.0, 0
    for cell in set(expected) | set(counts):
        obs, exp = counts.get(cell, 0), expected.get(cell, 0.0) * total
        if exp < min_expected:
            observed_small, expected_small = observed_small + obs, expected_small + exp
            continue
        stat, cells = stat + (obs - exp) ** 2 / exp, cells + 1
    if expected_small > 0:
        stat, cells = stat + (observed_small - expected_small) ** 2 / expected_small, cells + 1
    dof = max(cells - 1, 1)
    return stat, float(chi2.sf(stat, dof)), dof


def total_variation(counts: dict[tuple[int, ...], int],
                    expected: dict[tuple[int, ...], float]) -> float:
    """Total variation distance between the empirical distribution of `counts` and the exact
    probabilities `expected`: how far a sampler drifts (sampling noise alone leaves ~0.5 *
    sum sqrt(p (1 - p) / n) * sqrt(2 / pi), a floor that shrinks with the samples)."""
    total = sum(counts.values())
    cells = set(expected) | set(counts)
    return 0.5 * sum(abs(counts.get(c, 0) / total - expected.get(c, 0.0)) for c in cells)


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, (var / n) ** 0.5


def leviathan_expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per step of a gamma-chain whose tokens are each accepted with prob alpha
    (Leviathan et al. 2023, eq. 1): (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha == 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


