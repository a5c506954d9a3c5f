"""Correctness evaluation, one row per drafter x acceptance rule: which variants are exact.

    python -m experiments.correctness drafter=draft_model tree=tree8
    python -m experiments.correctness target=tiny_llama drafter=prompt_lookup greedy.num_prompts=4

- greedy: output token-identical to the target's plain greedy decoding (Hugging Face
  `generate`) on Spec-Bench prompts: match rate and first divergence.
- sampling: the distribution of generated sequences against the exact target distribution
  (chi-square over the first tokens, on a tiny-vocabulary target with fixed seeds), for exact
  tree sampling, for typical acceptance (lossy by design), for block verification where the
  drafter proposes chains (a static chain topology), and for a deliberately wrong rule that
  must fail: the test's negative control.
- chain: mean tokens per step of a chain with controlled acceptance rate alpha against
  Leviathan et al.'s (1 - alpha^(gamma+1)) / (1 - alpha).

Prints a markdown table, writes JSON, and exits 1 when a check fails.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from drafters import build_drafter, proposes_chains, rule_refusal
from experiments.chain import chain_rows
from experiments.common import (
    check_report,
    pick_questions,
    report_name,
    single_thread,
    write_report,
)
from experiments.stats import chi_square_test, sequence_distribution, total_variation
from experiments.table import markdown_table
from verify.accept import RuleRefusal, SpeculativeSamplingRule
from verify.loop import generate, generate_batch
from verify.metrics import TokensPerForward
from verify.multidraft import KSequentialRule
from verify.rules import RULES, make_rule
from verify.runtime.model import Target, build_tiny_model, hf_generate, load_target_from_config
from verify.sampling import SamplingParams
from verify.traversal import TraversalVerificationRule


class WrongResidualRule(SpeculativeSamplingRule):
    """Negative control: after a rejection it resamples from the target itself instead of
    the residual max(p - q, 0), a classic bug that over-produces drafted tokens."""

    name = "wrong-residual (control)"
    exact = False

    def residual(self, p, q):
        return p


class WrongTraversalRule(TraversalVerificationRule):
    """Traversal Verification's negative control: a deleted child leaves its parent's weight
    and target distribution as they were (no residual), so drafts are over-produced."""

    name = "traversal-no-residual (control)"
    exact = False

    def absorb(self, weight, target, proposal):
        return weight, target


class WrongKSequentialRule(KSequentialRule):
    """SpecTr's negative control: every i.i.d. draft tried at its token-level ratio (rho = 1),
    which over-produces drafted tokens once there are two drafts or more."""

    name = "spectr-rho1 (control)"
    exact = False

    def rho(self, p, q, draws):
        return 1.0


# each rule's deliberately wrong variant, run after it where the rule applies
CONTROLS = {"sampling": WrongResidualRule, "traversal": WrongTraversalRule,
            "spectr": WrongKSequentialRule}


REFERENCES = ("hf", "plain")


def greedy_row(target: Target, drafter, questions, max_new_tokens: int,
               pad_rows: int = 1, reference: str | None = None) -> dict:
    """Token-for-token comparison with the target's plain greedy decoding: Hugging Face
    `generate` ("hf"), or this loop's plain decoding on the same target step and padded
    shape ("plain": what pad_rows > 1 and target.step=compiled promise to match). None: "hf",
    or "plain" when pad_rows > 1."""
    reference_name = reference or ("plain" if pad_rows > 1 else "hf")
    if reference_name not in REFERENCES:
        raise ValueError(f"greedy.reference is one of {list(REFERENCES)} or null, "
                         f"not {reference!r}")
    identical, divergences, tally = 0, [], TokensPerForward()
    for question in tqdm(questions, desc="greedy vs plain", leave=False):
        ids = target.encode_prompt(question.prompt)
        eos = target.eos_token_ids
        reference = (hf_generate(target, ids, max_new_tokens) if reference_name == "hf" else
                     generate(target.step, ids, max_new_tokens, eos_token_id=eos,
                              pad_rows=pad_rows).tokens)
        result = generate(target.step, ids, max_new_tokens, drafter=drafter,
                          eos_token_id=eos, pad_rows=pad_rows)
        tally += result.tally
        first = first_divergence(result.tokens.tolist(), reference.tolist())
        identical += first is None
        if first is not None:
            divergences.append({"question_id": question.question_id, "position": first,
                                **divergence_margin(target.model, ids, reference, result.tokens,
                                                    first)})
    n = len(questions)
    padded = f", every forward padded to {pad_rows} rows" if pad_rows > 1 else ""
    against = "Hugging Face greedy" if reference_name == "hf" else "this loop's plain greedy"
    return {"rule": "greedy", "check": f"token match vs {against}, {n} prompts{padded}",
            "value": identical / n, "passed": identical == n, "exact_claimed": True,
            "detail": {"identical": identical, "prompts": n, "divergences": divergences,
                       # pooled over every prompt's steps, as the bench's tau (runs saved
                       # before were the mean of the prompts' own taus)
                       "tau": tally.tau}}


@torch.no_grad()
def divergence_margin(model, prompt: torch.Tensor, reference: torch.Tensor,
                      tokens: torch.Tensor, position: int) -> dict:
    """Where greedy output left the reference: the top-2 logit margin there and the rank of
    the token written instead, from one float32 forward over prompt + reference[:position]
    (a half-precision model's parameters are upcast for it and cast back, which restores
    them exactly): a referee that rounds like neither decoding. A margin within the dtype's
    rounding (bfloat16 logits of ~20 move in steps of 0.125) is a numerical near-tie; a wide
    margin with a high rank is an error."""
    if position >= min(len(reference), len(tokens)):  # one output stopped early: no token pair
        return {"margin": None, "written_rank": None}
    context = torch.cat([prompt, reference[:position]])[None].to(model.device)
    with float32_parameters(model):
        logits = model(context).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    rank = int((logits > logits[int(tokens[position])]).sum())
    return {"margin": float(top[0] - top[1]), "written_rank": rank}


@contextmanager
def float32_parameters(model) -> Iterator[None]:
    """Run `model` with float32 parameters, then give each back its own dtype (bfloat16 and
    float16 values survive the round trip unchanged). Buffers such as rotary tables keep
    theirs throughout."""
    dtypes = [(param, param.dtype) for param in model.parameters()]
    for param, _ in dtypes:
        param.data = param.data.float()
    try:
        yield
    finally:
        for param, dtype in dtypes:
            param.data = param.data.to(dtype)


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def distribution_rows(cfg: DictConfig) -> list[dict]:
    """Chi-square rows for exact sampling, typical acceptance and the negative control."""
    check_distribution(cfg.distribution)
    with single_thread():
        return _distribution_rows(cfg)


def _distribution_rows(cfg: DictConfig) -> list[dict]:
    dist = cfg.distribution
    model = build_tiny_model(dist.arch, seed=dist.seed, vocab_size=dist.vocab_size)
    small = Target(model.eval(), None, f"tiny-{dist.arch}-v{dist.vocab_size}")
    # overrides sized for the tiny target, for the keys this drafter has
    overrides = {k: v for k, v in dist.drafter_overrides.items() if k in cfg.drafter}
    drafter_cfg = OmegaConf.merge(cfg.drafter, overrides)
    # a fresh draft's weights come from torch's global generator: seeded, so that the rows
    # (and how far a control lands from the target) do not depend on what ran before
    torch.manual_seed(dist.seed)
    drafter = build_drafter(drafter_cfg, cfg.tree, small)
    params = SamplingParams(dist.temperature, dist.top_k, dist.top_p)
    # a repeating prompt, so that n-gram drafters find matches too
    prompt = torch.arange(dist.prompt_length) % dist.prompt_period
    expected = sequence_distribution(model, prompt, dist.length, params)
    # every registered rule that samples (greedy has its own row; chain rules on chains
    # only), each followed by its negative control; a rule refusing the drafter's trees gets
    # a row saying why, known from the configs (drafters.rule_refusal) without decoding
    chains, chosen = proposes_chains(cfg.drafter, cfg.tree), dist.get("rules")
    rows = []
    for name, rule in RULES.items():
        if name == "greedy" or (rule.chains_only and not chains) or (
                chosen is not None and name not in chosen):
            continue
        refusal = rule_refusal(name, drafter_cfg, cfg.tree)
        if refusal is not None:
            rows.append(refused_row(make_rule(name, params), RuleRefusal(refusal)))
            continue
        for variant in (make_rule(name, params), *(
                [CONTROLS[name]()] if name in CONTROLS else [])):
            try:
                rows.append(distribution_row(model, drafter, variant, prompt, expected, params,
                                             dist))
            except RuleRefusal as refusal:
                rows.append(refused_row(variant, refusal))
                break
    return rows


def refused_row(rule, refusal: RuleRefusal) -> dict:
    """A rule that does not apply to the drafter's trees: nothing measured, nothing failed."""
    return {"rule": rule.name, "check": f"refused: {refusal}", "value": float("nan"),
            "exact_claimed": rule.exact, "passed": None,
            "detail": {"refused": str(refusal)}}


def distribution_row(model, drafter, rule, prompt, expected, params, dist) -> dict:
    generator = torch.Generator().manual_seed(dist.seed)
    counts: Counter = Counter()
    drafted = 0  # draft tokens put to the test: a row whose drafter proposed none tests nothing
    tally = TokensPerForward()  # tokens per target forward after the prefill: the speed it buys
    for _ in tqdm(range(dist.samples // dist.batch_size), desc=f"sampling ({rule.name})",
                  leave=False):
        batch = generate_batch(model, [prompt] * dist.batch_size, dist.length, drafter=drafter,
                               sampling=params, rule=rule, generator=generator)
        for out in batch:
            counts[tuple(out.tokens.tolist())] += 1
            drafted += sum(step.tree_size - 1 for step in out.steps)
            tally += out.tally
    stat, p_value, dof = chi_square_test(counts, expected)
    consistent = p_value >= dist.alpha
    control = "control" in rule.name
    return {"rule": rule.name,
            "check": f"chi-square, first {dist.length} tokens, {dist.samples} samples"
                     + (f" in batches of {dist.batch_size}" if dist.batch_size > 1 else ""),
            "value": p_value, "exact_claimed": rule.exact,
            # an exact rule must look exact; the control must be caught; typical is reported
            "passed": consistent if rule.exact else (not consistent if control else None),
            "detail": {"statistic": stat, "dof": dof, "consistent_with_target": consistent,
                       "draft_tokens_per_sample": drafted / dist.samples,
                       "total_variation": total_variation(counts, expected),
                       "tokens_per_step": tally.tau}}


def check_distribution(dist: DictConfig) -> None:
    """Refuse, before anything loads (the greedy part takes minutes), a distribution test
    that cannot count: no samples (a chi-square over nothing divides by zero), no batch, or
    samples that batches do not divide."""
    if not dist.enabled:
        return
    for key in ("samples", "batch_size"):
        if dist[key] < 1:
            raise ValueError(f"distribution.{key} must be >= 1, got {dist[key]} (or "
                             "distribution.enabled=false to skip the distribution test)")
    if dist.samples % dist.batch_size:
        raise ValueError(f"distribution.samples={dist.samples} is not a multiple of "
                         f"distribution.batch_size={dist.batch_size}")


def evaluate(cfg: DictConfig) -> list[dict]:
    check_distribution(cfg.distribution)
    target = load_target_from_config(cfg.target)
    drafter = build_drafter(cfg.drafter, cfg.tree, target)
    questions = pick_questions(cfg.data_root, cfg.greedy.num_prompts)
    rows = [greedy_row(target, drafter, questions, cfg.greedy.max_new_tokens,
                       cfg.greedy.pad_rows, cfg.greedy.get("reference"))]
    if cfg.distribution.enabled:
        rows += distribution_rows(cfg)
    if cfg.chain.enabled:
        rows += chain_rows(cfg.chain)
    for row in rows:
        row.setdefault("drafter", cfg.drafter.name)
        row.setdefault("tree", cfg.tree.name)
    return rows


def format_table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        verdict = {True: "pass", False: "FAIL", None: "refused" if "refused" in r["detail"]
                   else "measured: not exact"
                   if not r["detail"].get("consistent_with_target", True) else "measured"}
        cells.append([r["drafter"], r["tree"], r["rule"], r["check"], f"{r['value']:.4g}",
                      "yes" if r["exact_claimed"] else "no", verdict[r["passed"]]])
    lines = [markdown_table(["drafter", "tree", "rule", "check", "value", "claimed exact",
                             "verdict"], cells)]
    divergences = [d for r in rows for d in r["detail"].get("divergences", [])]
    if divergences:
        lines += ["", "Greedy divergences (margin: top-1 minus top-2 logit of a float32 "
                  "forward over the reference's prefix; rank: the written token's rank there):"]
        lines += [f"- question {d['question_id']}, new token {d['position']}: " + (
            "one output ended early" if d["margin"] is None else
            f"margin {d['margin']:.3g}, rank {d['written_rank']}") for d in divergences]
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="correctness", version_base=None)
def main(cfg: DictConfig) -> None:
    # drafter and tree lead (readers glob `<drafter>-*`), then the target and the settings
    stem = report_name(cfg, lead=(cfg.drafter.name, cfg.tree.name))
    check_report(cfg.out_dir, stem, cfg)
    rows = evaluate(cfg)
    table = format_table(rows)
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(table)
    print(f"\nJSON: {path}")
    if any(row["passed"] is False for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
