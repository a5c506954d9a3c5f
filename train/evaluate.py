"""End-of-training evaluation on held-out prompts (training prompts never trained on).

- accuracy: per head, how often its top-1 / top-5 holds the token the target wrote, and the
  rank table (rank r's share) that drafters.measured_tree turns into a tree;
- decoding: tau (tokens per target forward) with that tree, and whether the output is token for
  token the target's own greedy output (Hugging Face `generate` on the same weights).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from drafters.medusa import MedusaHeads
from train.distill import Answer
from train.loop import chunks
from train.medusa import answer_batch_inputs, head_targets
from verify.loop import generate
from verify.metrics import TokensPerForward
from verify.protocol import Drafter, DraftStats
from verify.runtime.model import Target, hf_generate


@torch.no_grad()
def answer_states(model: torch.nn.Module, answers: list[Answer], batch_size: int = 8
                  ) -> torch.Tensor:
    """(N, H) last-layer states of the answers' tokens (row s of an answer predicted its
    token s), teacher-forced in right-padded batches: the states decoding hands the heads."""
    states = []
    for batch in chunks(answers, batch_size):
        input_ids, attention_mask, rows = answer_batch_inputs(batch)
        out = model.base_model(input_ids=input_ids.to(model.device),
                               attention_mask=attention_mask.to(model.device))
        states.append(out.last_hidden_state[rows[:, 0], rows[:, 1]].float().cpu())
    return torch.cat(states)


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, answers: list[Answer],
                  top_k: int) -> dict:
    """Per-head top-1 / top-5 accuracy and rank_accuracy[k][r] = P(head k's rank-r token is
    right), over every answer state with a target; out-of-vocabulary targets count as misses."""
    targets = torch.cat([head_targets(a.response, heads.num_heads) for a in answers])
    weight = heads.head_lm(0).weight
    index = heads.draft_index()
    table, top1, top5 = [], [], []
    for k in range(heads.num_heads):
        has = targets[:, k] >= 0
        draft = index[targets[has, k]]  # (n,), -1 outside the draft vocabulary
        logits = heads.head_logits(hidden[has].to(weight), k).float().cpu()
        ranks = logits.topk(top_k, dim=-1).indices  # (n, top_k)
        hit = (ranks == draft[:, None]) & (draft[:, None] >= 0)
        share = hit.float().mean(0)  # (top_k,): rank r's share
        table.append(share.tolist())
        top1.append(float(share[0]))
        top5.append(float(share[:5].sum()))
    return {"top1": top1, "top5": top5, "rank_accuracy": table, "rows": int(len(targets))}


def decode_check(target: Target, drafter: Drafter, prompts: list[torch.Tensor],
                 max_new_tokens: int, tree: str) -> dict:
    """Greedy decoding of held-out prompts with a trained drafter: the loop's own tau, whether
    the output is token for token the target's (Hugging Face greedy `generate`), the drafting
    time per step and, for a drafter running a DraftEngine, per draft forward."""
    stats = drafter if isinstance(drafter, DraftStats) else None  # a draft model's forwards
    draft_forwards_before = stats.draft_forwards if stats is not None else 0
    tally, identical = TokensPerForward(), 0
    draft_s = 0.0
    for ids in tqdm(prompts, desc="evaluating decoding"):
        result = generate(target.step, ids, max_new_tokens, drafter=drafter,
                          eos_token_id=target.eos_token_ids)
        reference = hf_generate(target, ids, max_new_tokens)
        identical += int(torch.equal(result.tokens, reference.cpu()))
        tally += result.tally
        draft_s += result.draft_s
    results = {"tau": tally.tau, "identical": identical,
               "prompts": len(prompts), "tree": tree,
               "draft_ms_per_step": 1e3 * draft_s / max(tally.forwards, 1)}
    if stats is not None:  # what one draft forward costs: the figure a vocabulary trades
        draft_forwards = stats.draft_forwards - draft_forwards_before
        results["draft_ms_per_forward"] = 1e3 * draft_s / max(draft_forwards, 1)
    return results
