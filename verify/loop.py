"""The draft -> verify -> accept loop.

One step: the drafter proposes a tree rooted at the last decided token, the target scores every
node in one forward, the acceptance rule picks a path plus a bonus token, the cache keeps the
path, and the bonus token becomes the next root. With no drafter every tree is the root alone,
which is plain decoding through the same code. A batch runs every row's step in the same
target forward; one prompt is the batch of one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from verify.accept import AcceptanceRule
from verify.metrics import TokensPerForward
from verify.predictions import top_k_predictions
from verify.protocol import BatchDrafter, DraftContext, Drafter
from verify.rules import RuleConfig, rule_from_config
from verify.runtime.features import LAST
from verify.runtime.model import context_window
from verify.runtime.step import TargetStep, as_step, host_threads
from verify.runtime.timing import Clock, device_clock
from verify.sampling import GREEDY, SamplingParams, sample, warp
from verify.tree import TokenTree, TreeBatch
from verify.verifier import TreeVerifier


@dataclass
class StepStats:
    """One target forward: draft tokens accepted (bonus not counted), the tree's size/depth."""

    accepted: int
    tree_size: int
    tree_depth: int
    draft_s: float
    verify_s: float


@dataclass
class GenerationResult:
    """tokens: (M,) the new tokens (EOS included when generated); steps: one per target forward
    after the prefill; states: with keep_states, (M, H) the target's last-layer state (what
    its LM head read) that predicted each new token, on the model's device and in its dtype.
    prefill_s: the prefill's seconds; decode_s: the seconds from its end to this row's last
    step (drafting, verifying and the loop's own time); a batch's rows share both."""

    tokens: torch.Tensor
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    states: torch.Tensor | None = None
    decode_s: float = 0.0

    @property
    def tally(self) -> TokensPerForward:
        """Tokens produced and target forwards, to pool with other results' (verify.metrics)."""
        return TokensPerForward.of(s.accepted for s in self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens produced per target forward, bonus token included."""
        return self.tally.tau

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def verify_s(self) -> float:
        return sum(s.verify_s for s in self.steps)

    @property
    def loop_s(self) -> float:
        """The loop's own seconds over the steps (decode_s less drafting and verifying): its
        bookkeeping between them. For a decode of one row (a batch's rows share steps)."""
        return max(self.decode_s - self.draft_s - self.verify_s, 0.0)


def generate(step: TargetStep | PreTrainedModel, input_ids: torch.Tensor,
             max_new_tokens: int, *,
             drafter: Drafter | None = None, sampling: SamplingParams = GREEDY,
             rule: RuleConfig = None,
             eos_token_id: int | Sequence[int] | None = None,
             generator: torch.Generator | None = None, pad_rows: int = 1) -> GenerationResult:
    """Speculative generation from a (T,) prompt; with drafter=None, plain decoding.

    step: the target's step (`Target.step`: packed, compiled or on OpenVINO as the target was
    loaded), or a bare model, decoded through its eager step (verify/runtime/step.py).
    sampling: temperature, top-k and top-p (verify.sampling.SamplingParams; GREEDY, temperature
    0, by default); top_k 0 and top_p 1 switch those filters off. The same warp applies to
    target and draft distributions. The rule defaults to greedy at temperature 0 and exact
    tree sampling otherwise ("typical" selects Medusa's lossy rule; a mapping sets
    its settings, {name: typical, epsilon: 0.05}: verify.accept.rule_from_config). Generation
    stops at any of the EOS ids (models such as Llama-3-Instruct list several), as Hugging
    Face `generate` does. The one-row case of `generate_batch`.
    """
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() > 1 and input_ids.shape[0] > 1:
        raise ValueError(f"generate decodes one prompt, got shape {tuple(input_ids.shape)}: "
                         "use generate_batch for a batch")
    return generate_batch(step, [input_ids.flatten()], max_new_tokens, drafter=drafter,
                          sampling=sampling, rule=rule, eos_token_id=eos_token_id,
                          generator=generator, pad_rows=pad_rows)[0]


def generate_batch(step: TargetStep | PreTrainedModel,
                   prompts: Sequence[torch.Tensor] | torch.Tensor,
                   max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
                   pad_token_id: int | None = None, drafter: Drafter | None = None,
                   sampling: SamplingParams = GREEDY, rule: RuleConfig = None,
                   eos_token_id: int | Sequence[int] | None = None,
                   generator: torch.Generator | None = None,
                   keep_states: bool = False, pad_rows: int = 1,
                   max_batch_for_speculation: int | None = None) -> list[GenerationResult]:
    """Decode B prompts together; one result per prompt, in order.

    prompts: a list of (T_b,) tensors, or a (B, T) tensor with its (B, T) attention_mask
    (left or right padding). A (B, T) tensor without a mask is refused when it holds the pad
    token (pad_token_id, else the model's): padding read as text would change the output.
    Each row gets its own tree, cached length and accepted path; the trees are padded to a
    common size and verified in one target forward. A `BatchDrafter` (EAGLE, the draft model,
    Medusa) drafts every row's tree at once (`propose_batch`); any other drafter drafts row by row,
    `drafter.fork()` giving every row after the first its own drafter state. A row that
    finishes leaves the batch. Every row's output is what decoding its prompt alone gives
    (greedy: the same tokens; sampling: the same distribution). keep_states returns each new
    token's last-layer state (self-distillation data) in `GenerationResult.states`.
    pad_rows: every step's forward runs at least that many tree rows (padding nodes,
    discarded): one matrix shape for plain and tree steps alike, so a node's numbers cannot
    depend on its tree's size (a batch-invariant mode for half precision, where kernels for
    different shapes round differently).
    max_batch_for_speculation: while more rows than this are active, steps decode plainly (no
    drafting: a wide batch already fills the matrix products, and trees only add work; this
    CPU's measured crossover is B = 4); checked every step, so drafting resumes as rows
    finish. None: always draft. Other arguments as in `generate`.
    """
    if max_batch_for_speculation is not None and max_batch_for_speculation < 0:
        raise ValueError(f"max_batch_for_speculation must be >= 0 or None, got "
                         f"{max_batch_for_speculation}")
    step = as_step(step)
    model = step.model
    rows = [_check_inputs(model, prompt, max_new_tokens)
            for prompt in _split_prompts(model, prompts, attention_mask, pad_token_id)]
    rule = rule_from_config(rule, sampling)
    stop = _eos_set(eos_token_id)
    features = _Features(drafter.feature_layers if drafter is not None else (), keep_states,
                         model.config.hidden_size)
    with host_threads(step):  # torch's own work beside the step's kernels
        verifier = TreeVerifier(step, features.layers)
        verifier.compile_graphs(len(rows))  # a compiled step's graphs, once, before the clock
        clock = device_clock(model.device)  # synchronises an accelerator before each reading
        start = clock()
        logits, prompt_features = verifier.prefill_batch(rows)
        first = _first_tokens(logits, sampling, generator)
        prefill_s = clock() - start
        # a batch drafter drafts every row in step; any other drafter drafts row by row, one
        # fork each
        batch_drafter = drafter if isinstance(drafter, BatchDrafter) else None
        row_drafters = [None] * len(rows) if batch_drafter else _fork(drafter, len(rows))
        sequences = []
        for b, (prompt, row_drafter) in enumerate(zip(rows, row_drafters)):
            sequence = _Sequence(prompt, [first[b]], row_drafter, None,
                                 GenerationResult(torch.empty(0, dtype=torch.long),
                                                  prefill_s=prefill_s))
            # the prompt's last state predicted the first new token
            features.take(sequence, None if prompt_features is None else prompt_features[b], last=1)
            sequences.append(sequence)
        if batch_drafter is not None:
            batch_drafter.begin_batch(rows)
        for sequence in sequences:
            if sequence.drafter is not None:
                sequence.drafter.begin(sequence.prompt)
        active = _drop_finished(verifier, batch_drafter, sequences, max_new_tokens, stop)
        target_top_k = drafter.target_top_k if drafter is not None else 0
        # a step that pads trees to a few shapes pads a drafting decode's root-only steps too
        tree_width = (max(pad_rows, getattr(step, "drafting_width", 1)) if drafter is not None
                      else pad_rows)
        decode_start = clock()
        while active:
            drafting = max_batch_for_speculation is None or len(active) <= max_batch_for_speculation
            _step(verifier, batch_drafter if drafting else None, active, rule, sampling, generator,
                  features, clock, tree_width if drafting else pad_rows, drafting,
                  target_top_k)
            now = clock()
            for sequence in active:  # a finished row keeps the time of its last step
                sequence.result.decode_s = now - decode_start
            active = _drop_finished(verifier, batch_drafter, active, max_new_tokens, stop)
        for sequence in sequences:
            sequence.result.tokens = _truncate(sequence.tokens, max_new_tokens, stop)
            if keep_states:
                sequence.result.states = torch.cat(sequence.states)[:len(sequence.result.tokens)]
        return [sequence.result for sequence in sequences]


def _first_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> list[int]:
    """Each row's first new token from its (B, V) prefill logits. Greedy takes the argmax and
    draws nothing: greedy decoding leaves the random state alone (training seeds by it)."""
    if params.greedy:
        return logits.argmax(-1).tolist()
    probs = warp(logits, params)
    return [sample(row, generator) for row in probs]


class _Features:
    """Which hidden states the verifier returns and who gets them: the drafter's layers (its
    DraftContext.features), then, with keep_states, the last layer's (GenerationResult.states)."""

    def __init__(self, drafter_layers: tuple[int, ...], keep_states: bool, hidden_size: int):
        self.layers = tuple(drafter_layers) + (LAST if keep_states else ())
        self.keep_states = keep_states
        self.drafter_width = len(drafter_layers) * hidden_size  # their columns come first

    def take(self, sequence: _Sequence, rows: torch.Tensor | None, last: int | None = None
             ) -> None:
        """Hand the (k, F * H) rows the target just cached to `sequence`: all k to its drafter,
        the last `last` (None: all) states to its result."""
        if rows is None:
            return
        if self.drafter_width:
            rows_for_drafter = rows[:, :self.drafter_width]
            if sequence.features is not None and not sequence.features_seen:
                # a step without drafting: the drafter gets these rows too, in order
                rows_for_drafter = torch.cat([sequence.features, rows_for_drafter])
            sequence.features, sequence.features_seen = rows_for_drafter, False
        if self.keep_states:
            kept = rows[:, self.drafter_width:]
            sequence.states.append(kept if last is None else kept[-last:])


@dataclass
class _Sequence:
    """One row of a batch: its prompt, the tokens decided so far, its drafter and the features
    of the tokens its target cached last."""

    prompt: torch.Tensor
    tokens: list[int]
    drafter: Drafter | None
    features: torch.Tensor | None
    result: GenerationResult
    states: list[torch.Tensor] = field(default_factory=list)  # keep_states: one part per step
    features_seen: bool = False  # whether the drafter has proposed from `features` yet

    def context(self) -> torch.Tensor:
        return torch.cat([self.prompt, torch.tensor(self.tokens, dtype=torch.long)])

    def finished(self, max_new_tokens: int, stop: frozenset[int]) -> bool:
        # an EOS anywhere in the decided tokens ends the row, inside an accepted path too
        return len(self.tokens) >= max_new_tokens or not stop.isdisjoint(self.tokens)


def _fork(drafter: Drafter | None, rows: int) -> list[Drafter | None]:
    if drafter is None or rows == 1:
        return [drafter] * rows
    if not hasattr(drafter, "fork"):
        raise TypeError(f"{type(drafter).__name__} cannot decode a batch: it has no fork() "
                        "that gives another sequence its own drafter state")
    return [drafter] + [drafter.fork() for _ in range(rows - 1)]


def _drop_finished(verifier: TreeVerifier, batch_drafter: BatchDrafter | None,
                   active: list[_Sequence], max_new_tokens: int,
                   stop: frozenset[int]) -> list[_Sequence]:
    """The rows still decoding; finished ones leave the verifier's (and batch drafter's) batch."""
    keep = [i for i, s in enumerate(active) if not s.finished(max_new_tokens, stop)]
    if len(keep) < len(active) and keep:
        verifier.keep_rows(torch.tensor(keep))
        if batch_drafter is not None:
            batch_drafter.keep_rows(torch.tensor(keep))
    return [active[i] for i in keep]


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(i) for i in eos_token_id)


def _step(verifier: TreeVerifier, batch_drafter: BatchDrafter | None, active: list[_Sequence],
          rule: AcceptanceRule, params: SamplingParams, generator: torch.Generator | None,
          features: _Features, clock: Clock, pad_rows: int = 1, drafting: bool = True,
          target_top_k: int = 0) -> None:
    """One target forward for every active row: draft each row's tree, verify them together,
    accept per row, commit, and tell the drafters (with target_top_k > 0, the target's top-k
    at each node of their trees too). A batch drafter's time is shared out evenly among the
    rows, so the rows' draft times add up to the step's either way. Without `drafting`, every
    tree is its root alone and no drafter is asked or told anything. `clock` reads the time
    (verify.runtime.timing.device_clock: after the device's queued work)."""
    if drafting:
        trees, draft_s = _propose(verifier, batch_drafter, active, params, generator, clock)
    else:
        trees = [TokenTree(torch.tensor(s.tokens[-1:]), torch.tensor([-1])) for s in active]
        draft_s = [0.0] * len(active)
    start = clock()
    batch = TreeBatch.pad(trees, pad_rows)
    logits, tree_features = verifier.verify_batch(batch)
    acceptances = rule.accept_batch(trees, batch, logits, params, generator)
    verifier.commit_batch([acceptance.path for acceptance in acceptances])
    verify_s = clock() - start
    start = clock()
    if drafting and target_top_k:  # work for the drafters: timed with their updates
        predictions = top_k_predictions(logits, [len(tree) for tree in trees], target_top_k)
        acceptances = [replace(acceptance, predictions=p)
                       for acceptance, p in zip(acceptances, predictions)]
    if batch_drafter is not None:
        batch_drafter.update_batch(trees, acceptances)
    update_s = (clock() - start) / len(active)
    for row, (sequence, tree, acceptance) in enumerate(zip(active, trees, acceptances)):
        start = clock()
        if sequence.drafter is not None and drafting:
            sequence.drafter.update(tree, acceptance)
        sequence.result.steps.append(StepStats(
            acceptance.num_accepted, len(tree), tree.depth,
            draft_s[row] + update_s + clock() - start, verify_s))
        sequence.tokens.extend([int(t) for t in tree.tokens[acceptance.path[1:]]]
                               + [acceptance.bonus])
        if tree_features is not None:
            path = torch.tensor(acceptance.path, device=tree_features.device)
            # each path node's state predicted the token after it: path[1:] and the bonus
            features.take(sequence, tree_features[row].index_select(0, path))


def _propose(verifier: TreeVerifier, batch_drafter: BatchDrafter | None,
             active: list[_Sequence], params: SamplingParams,
             generator: torch.Generator | None, clock: Clock
             ) -> tuple[list[TokenTree], list[float]]:
    """Every active row's tree (a lone root without a drafter) and its draft seconds, as
    `clock` reads them."""
    contexts = [DraftContext(s.context(), s.features, params, generator) for s in active]
    for sequence in active:
        sequence.features_seen = True
    if batch_drafter is not None:
        start = clock()
        proposed = batch_drafter.propose_batch(contexts)
        share = (clock() - start) / len(active)
        if len(proposed) != len(active):
            raise ValueError(f"propose_batch returned {len(proposed)} trees for "
                             f"{len(active)} sequences")
        trees = [_checked(tree, ctx.tokens, verifier.model, cached)
                 for tree, ctx, cached in zip(proposed, contexts, verifier.lengths.tolist())]
        return trees, [share] * len(active)
    trees, draft_s = [], []
    for sequence, ctx, cached in zip(active, contexts, verifier.lengths.tolist()):
        start = clock()
        if sequence.drafter is None:
            trees.append(TokenTree(ctx.tokens[-1:], torch.tensor([-1])))
        else:
            trees.append(_checked(sequence.drafter.propose(ctx), ctx.tokens, verifier.model,
                                  cached))
        draft_s.append(clock() - start)
    return trees, draft_s


def _checked(tree: TokenTree, context: torch.Tensor, model: PreTrainedModel,
             cached: int) -> TokenTree:
    """A drafter's tree, refused unless rooted at the last token, and cut to the root alone
    where it would overrun the model's context window (near its end: decode plainly)."""
    if int(tree.tokens[0]) != int(context[-1]):
        raise ValueError(f"drafter returned a tree rooted at {int(tree.tokens[0])}, "
                         f"not at the last token {int(context[-1])}")
    window = context_window(model)
    if window is None or tree.depth < window - cached:
        return tree
    return TokenTree(context[-1:], torch.tensor([-1]))


def _split_prompts(model: PreTrainedModel, prompts: Sequence[torch.Tensor] | torch.Tensor,
                   attention_mask: torch.Tensor | None,
                   pad_token_id: int | None) -> list[torch.Tensor]:
    """The prompts as a list of (T_b,) tensors, padding removed."""
    if not isinstance(prompts, torch.Tensor):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a (B, T) tensor of prompts, not a list")
        return list(prompts)
    if prompts.dim() == 1:
        return [prompts]
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be (B, T) or a list of (T,), got {tuple(prompts.shape)}")
    if attention_mask is None:
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        if len(prompts) > 1 and pad is not None and bool((prompts == pad).any()):
            raise ValueError(f"the (B, T) prompts hold the pad token {pad} but no attention_mask "
                             "says which tokens are padding: pass attention_mask, or a list of "
                             "unpadded (T,) prompts")
        return list(prompts)
    if attention_mask.shape != prompts.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match the "
                         f"prompts {tuple(prompts.shape)}")
    rows = []
    for row, keep in zip(prompts, attention_mask.bool()):
        where = keep.nonzero().flatten()
        if len(where) and int(where[-1] - where[0]) + 1 != len(where):
            raise ValueError("each attention_mask row must mark one contiguous run of tokens "
                             "(left or right padding)")
        rows.append(row[keep])
    return rows


def _check_inputs(model: PreTrainedModel, input_ids: torch.Tensor,
                  max_new_tokens: int) -> torch.Tensor:
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = model.get_input_embeddings().weight.shape[0]
    outside = input_ids[(input_ids < 0) | (input_ids >= vocab)]
    if len(outside):
        raise ValueError(f"token id {int(outside[0])} of the prompt is outside the target's "
                         f"vocabulary of {vocab} (ids 0..{vocab - 1}): encode prompts with "
                         "the target's own tokenizer")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    limit = context_window(model)
    if limit is not None and len(input_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context window of {limit} tokens")
    return input_ids


def _truncate(tokens: list[int], max_new_tokens: int, stop: frozenset[int]) -> torch.Tensor:
    return torch.tensor(until_eos(tokens[:max_new_tokens], stop), dtype=torch.long)


def until_eos(tokens: list[int], eos: Collection[int], *, keep_eos: bool = True) -> list[int]:
    """`tokens` up to the first of the `eos` ids, that id included unless `keep_eos` is false
    (to compare outputs of engines that differ in whether they return it); all of them if
    none."""
    ends = [i for i, token in enumerate(tokens) if token in eos]
    return tokens[: ends[0] + int(keep_eos)] if ends else tokens
