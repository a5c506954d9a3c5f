"""Draft-OPD's rollouts: the draft drafts, the target verifies, and every step is recorded.

A rollout decodes a prompt speculatively through the loop itself (verify.loop.generate_batch)
with a block drafter on a chain: the sequence is the target's (greedy, or exact sampling), the
chains are the draft's own proposals, so the states they put the draft in are on-policy.
`RecordingDrafter` wraps the drafter and records, per step, the root's position, the chain it
drafted and how many of its tokens the target accepted: the loop already tells a drafter that
after every verification (`update(tree, acceptance)`), so the loop needs no hook.

Then one target forward per rollout (`target_states`) gives everything the loss needs: the
sequence packed with every step's drafted prefix d_1..d_{C-1} under train.pard.layout_mask
(the sequence causal; prefix node (r, g) sees the sequence up to and including its root r and
nodes (r, 1..g) of its own chain, at position r + g), as a tree verification would place them.
It returns the sequence's features at the draft's layers (its context) and the target's last
state before each drafted position k = 1..C: the root's for k = 1, node k - 1's after, rejected
nodes included (conditioned on the drafted prefix, whatever the target kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from train.pard import layout_mask
from verify.accept import Acceptance
from verify.loop import generate_batch
from verify.protocol import DraftContext, Drafter
from verify.runtime.features import num_layers, resolve_layers, select_features
from verify.runtime.model import Target
from verify.sampling import SamplingParams
from verify.tree import TokenTree


@dataclass
class RolloutStep:
    """One verification: the root at `root` (its position in the sequence), the chain
    `drafted` (C,) long the draft proposed after it, and `accepted`, how many of its tokens the
    target accepted (0..C)."""

    root: int
    drafted: torch.Tensor
    accepted: int


@dataclass
class Rollout:
    """A decoded prompt: tokens (T,) the prompt then what the loop decoded (EOS included,
    cut at max_new_tokens), the prompt's length, and every step that drafted a chain."""

    tokens: torch.Tensor
    prompt_length: int
    steps: list[RolloutStep] = field(default_factory=list)


class RecordingDrafter:
    """`drafter` with every call passed through, recording each step into `rows[row]`.

    generate_batch drafts row by row with `fork()`s of the drafter it is given, one per row
    after the first, in row order; each fork records into the next row of the same `rows`.
    A step is recorded at `update` (the tree the loop verified, after any cut near the context
    window's end); a step whose tree is the root alone drafted nothing and is left out."""

    def __init__(self, drafter: Drafter, chain: int, rows: list[list[RolloutStep]] | None = None):
        self.drafter, self.chain = drafter, chain
        self.rows = [] if rows is None else rows
        self.steps: list[RolloutStep] = []
        self.rows.append(self.steps)
        self.feature_layers = drafter.feature_layers
        self.target_top_k = drafter.target_top_k
        self._root = -1

    def begin(self, prompt: torch.Tensor) -> None:
        self.drafter.begin(prompt)

    def propose(self, ctx: DraftContext) -> TokenTree:
        self._root = len(ctx.tokens) - 1
        return self.drafter.propose(ctx)

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        self.drafter.update(tree, acceptance)
        if len(tree) == 1:
            return
        if len(tree) != self.chain + 1 or tree.parents.tolist() != list(range(-1, self.chain)):
            raise ValueError(f"a rollout step proposed a tree of {len(tree)} nodes with parents "
                             f"{tree.parents.tolist()}, not a chain of {self.chain}: Draft-OPD "
                             "rolls out chains")
        self.steps.append(RolloutStep(self._root, tree.tokens[1:].clone(),
                                      acceptance.num_accepted))

    def fork(self) -> RecordingDrafter:
        return RecordingDrafter(self.drafter.fork(), self.chain, self.rows)


@torch.no_grad()
def roll_out(target: Target, drafter: Drafter, chain: int, prompts: list[torch.Tensor],
             max_new_tokens: int, sampling: SamplingParams,
             generator: torch.Generator | None = None) -> list[Rollout]:
    """Decode `prompts` (each (P_i,)) together on the target's step (`target.step`: OpenVINO's
    kernels when loaded with step=openvino), `drafter` proposing chains of `chain` tokens;
    one Rollout per prompt, in order. `generator` draws the sampled tokens (None when greedy:
    nothing is drawn)."""
    recorder = RecordingDrafter(drafter, chain)
    results = generate_batch(target.step, prompts, max_new_tokens, drafter=recorder,
                             sampling=sampling, eos_token_id=target.eos_token_ids,
                             generator=generator)
    return [Rollout(torch.cat([prompt, result.tokens.to(prompt.device)]), len(prompt), steps)
            for prompt, result, steps in zip(prompts, results, recorder.rows)]


def packed_layout(rollout: Rollout, chain: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """The packed forward's queries, the sequence's T tokens first, then each step's drafted
    prefix d_1..d_{C-1}: tokens (N,), anchors (N,) (the position a sequence token holds; a
    prefix node's root) and offsets (N,) (0 in the sequence; g for node d_g), N = T + S (C - 1)
    over the S steps. A node's position is anchor + offset."""
    length = len(rollout.tokens)
    roots = torch.tensor([step.root for step in rollout.steps], dtype=torch.long)
    depth = chain - 1
    prefix = (torch.stack([step.drafted[:depth] for step in rollout.steps]).flatten()
              if rollout.steps else torch.empty(0, dtype=torch.long))
    tokens = torch.cat([rollout.tokens, prefix])
    anchors = torch.cat([torch.arange(length), roots.repeat_interleave(depth)])
    offsets = torch.cat([torch.zeros(length, dtype=torch.long),
                         torch.arange(1, depth + 1).repeat(len(roots))])
    return tokens, anchors, offsets


@torch.no_grad()
def target_states(model: PreTrainedModel, rollout: Rollout, feature_layers: tuple[int, ...],
                  chain: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the target over the rollout's sequence and every step's drafted prefix
    (packed_layout, train.pard.layout_mask). Returns the sequence's features (T, F * H) at
    `feature_layers` (the draft's context) and the last states (S, C, H) whose next-token
    distributions the S steps' draft positions k = 1..C learn: the root's, then those of the
    drafted nodes d_1..d_{C-1}. Float32 on the model's device."""
    total = num_layers(model.config)
    layers = resolve_layers(feature_layers, total)
    tokens, anchors, offsets = (t.to(model.device) for t in packed_layout(rollout, chain))
    mask = layout_mask(anchors, offsets, model.dtype)
    out = model.base_model(input_ids=tokens[None], position_ids=(anchors + offsets)[None],
                           attention_mask=mask, output_hidden_states=True)
    length, width = len(rollout.tokens), len(layers) * model.config.hidden_size
    states = select_features(out.hidden_states, (*layers, total))[0].float()  # (N, F*H + H)
    last = states[:, width:]
    roots = torch.tensor([step.root for step in rollout.steps], dtype=torch.long,
                         device=model.device)
    nodes = last[length:].view(len(roots), chain - 1, last.shape[-1])
    return states[:length, :width], torch.cat([last[roots][:, None], nodes], dim=1)


def rollout_batch(rollouts: list[Rollout], features: list[torch.Tensor],
                  states: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rollouts right-padded into one batch for train.opd.OnPolicyLoss, with each one's
    `target_states` (features (T_i, C'), states (S_i, C, H)):

    input_ids (B, T) long, features (B, T, C') float, learn (B, T) bool (the decoded tokens:
    what a learning curve counts), starts (B, A) long (each step's root position), valid
    (B, A) bool, drafted (B, A, C) long, accepted (B, A) long, target_states (B, A, C, H)
    float; A is the most steps of a rollout (at least 1: a batch whose rollouts drafted
    nothing has one invalid step)."""
    batch, width = len(rollouts), max(len(r.tokens) for r in rollouts)
    steps = max(1, max(len(r.steps) for r in rollouts))
    chain, hidden = states[0].shape[1], states[0].shape[2]
    padded = {
        "input_ids": torch.zeros(batch, width, dtype=torch.long),
        "features": torch.zeros(batch, width, features[0].shape[-1]),
        "learn": torch.zeros(batch, width, dtype=torch.bool),
        "starts": torch.zeros(batch, steps, dtype=torch.long),
        "valid": torch.zeros(batch, steps, dtype=torch.bool),
        "drafted": torch.zeros(batch, steps, chain, dtype=torch.long),
        "accepted": torch.zeros(batch, steps, dtype=torch.long),
        "target_states": torch.zeros(batch, steps, chain, hidden),
    }
    for row, (rollout, row_features, row_states) in enumerate(zip(rollouts, features, states)):
        length, count = len(rollout.tokens), len(rollout.steps)
        padded["input_ids"][row, :length] = rollout.tokens
        padded["features"][row, :length] = row_features.cpu()
        padded["learn"][row, rollout.prompt_length:length] = True
        if count:
            padded["starts"][row, :count] = torch.tensor([s.root for s in rollout.steps])
            padded["valid"][row, :count] = True
            padded["drafted"][row, :count] = torch.stack([s.drafted for s in rollout.steps])
            padded["accepted"][row, :count] = torch.tensor([s.accepted for s in rollout.steps])
            padded["target_states"][row, :count] = row_states.cpu()
    return padded
