"""Tokens per step of a chain with a controlled acceptance rate, against Leviathan et al.

A synthetic drafter proposes the target's own greedy continuation, each token independently
replaced by a wrong one with probability 1 - alpha. Under greedy verification the number of
accepted tokens is then truncated-geometric, so the mean tokens per step must match
(1 - alpha^(gamma+1)) / (1 - alpha): a check of the loop's bookkeeping against theory.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from experiments.common import single_thread
from experiments.stats import leviathan_expected_tokens, mean_and_stderr
from verify.loop import generate
from verify.metrics import step_tokens
from verify.runtime.model import build_tiny_model
from verify.tree import TokenTree


class ControlledChainDrafter:
    """Drafts `gamma` tokens of a known continuation, each right with probability alpha."""

    feature_layers = ()  # reads no target hidden states
    target_top_k = 0  # asks for none of the target's predictions

    def __init__(self, reference: torch.Tensor, prompt_len: int, alpha: float, gamma: int,
                 vocab_size: int, generator: torch.Generator):
        self.reference, self.prompt_len = reference.tolist(), prompt_len
        self.alpha, self.gamma, self.vocab = alpha, gamma, vocab_size
        self.generator = generator

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, ctx) -> TokenTree:
        done = len(ctx.tokens) - self.prompt_len
        right = self.reference[done:done + self.gamma]
        keep = torch.rand(len(right), generator=self.generator) < self.alpha
        chain = [t if k else (t + 1) % self.vocab for t, k in zip(right, keep.tolist())]
        return TokenTree.from_paths(int(ctx.tokens[-1]), [chain])

    def update(self, tree, acceptance) -> None:
        pass


def chain_rows(cfg: DictConfig) -> list[dict]:
    """One row per alpha: measured mean tokens per step against the closed form."""
    with single_thread():
        return _chain_rows(cfg)


def _chain_rows(cfg: DictConfig) -> list[dict]:
    model = build_tiny_model(cfg.arch, seed=cfg.seed)
    vocab = model.config.vocab_size
    prompts = [torch.arange(i, i + 16) % vocab for i in range(cfg.prompts)]
    references = [generate(model, p, cfg.max_new_tokens + cfg.gamma).tokens for p in prompts]
    return [chain_row(model, prompts, references, alpha, cfg) for alpha in cfg.alphas]


def chain_row(model, prompts, references, alpha: float, cfg: DictConfig) -> dict:
    generator = torch.Generator().manual_seed(cfg.seed)
    per_step = []
    for prompt, reference in zip(prompts, references):
        drafter = ControlledChainDrafter(reference, len(prompt), alpha, cfg.gamma,
                                         model.config.vocab_size, generator)
        result = generate(model, prompt, cfg.max_new_tokens, drafter=drafter)
        # the last step may be cut short by max_new_tokens; leave it out
        per_step += step_tokens(s.accepted for s in result.steps[:-1])
    mean, stderr = mean_and_stderr(per_step)
    expected = leviathan_expected_tokens(alpha, cfg.gamma)
    return {"drafter": "controlled chain", "tree": f"chain{cfg.gamma}", "rule": "greedy",
            "check": f"tokens/step vs (1-a^(g+1))/(1-a), alpha={alpha}",
            "value": mean, "exact_claimed": True,
            "passed": abs(mean - expected) <= cfg.tolerance_sigmas * stderr,
            "detail": {"alpha": alpha, "gamma": cfg.gamma, "expected": expected,
                       "stderr": stderr, "steps": len(per_step)}}
