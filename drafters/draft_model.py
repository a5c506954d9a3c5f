"""Draft-model drafting: a separate small causal LM with the target's tokenizer proposes the tree.

Leviathan et al. 2023 / Chen et al. 2023 draft a chain with a small model; SpecInfer expands a
tree from its top-k. With a static topology the child of rank r under a node is the draft
model's r-th best proposal after the path to that node (greedy: its top-k tokens; sampling:
draws without replacement from its warped distribution, recorded for exact acceptance); with
EAGLE-2's dynamic tree its confidence decides where the tree grows (drafters.trees.dynamic).

The draft can be any compatible model; the target itself cut to its first layers
(`truncated_copy`, a self-draft that needs no training); or a draft distilled from the target
(`python train.py drafter=draft_model`, train.draft_model), a Hugging Face folder whose LM head
may cover a reduced draft vocabulary (draft_vocab.json beside it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from drafters.checkpoint import (
    DRAFT_INFO_FILE,
    MODEL_KINDS,
    check_kind,
    check_target,
    read_config,
    target_record,
)
from drafters.config import shallow_config, typed_config
from drafters.engine import EngineDrafter, LevelAnswer, LevelRequest
from drafters.trees.dynamic import DynamicTree
from drafters.vocab import check_vocab_ids, copy_linear
from verify.accept import Acceptance
from verify.protocol import DraftContext
from verify.runtime.files import load_tensors, read_json, write_atomically
from verify.runtime.hf_state import batched_forward
from verify.runtime.loading import load_causal_lm, load_tokenizer, pretrained_source
from verify.runtime.model import Target, context_window
from verify.tree import TokenTree, TreeError, TreeTopology

# A distilled draft's vocab_ids (V',). JSON, not safetensors: engines (vLLM) load every
# *.safetensors file of a model folder as weights and refuse one that holds no parameter.
VOCAB_FILE = "draft_vocab.json"
LEGACY_VOCAB_FILE = "draft_vocab.safetensors"  # drafts distilled before: read, never written


class DraftModelDrafter(EngineDrafter):
    """Drafts a tree with a small causal LM whose KV cache (drafters.engine) holds the
    committed tokens `cached` (T,).

    Proposing appends the tree's levels to the cache; `update` keeps the entries of the path
    the target accepted, so the next proposal only feeds what the draft has not seen (the
    bonus token, and accepted leaves that were never fed). The tree is a static topology
    (filled level by level) or EAGLE-2's dynamic tree (drafters.trees.dynamic).

    vocab_ids (V',): the draft's reduced vocabulary, when its LM head has only those rows
    (a distilled draft, train.draft_model); None when it projects onto the whole vocabulary.
    """

    commits_accepted_path = True  # the fed entries are what re-running the tokens computes

    def __init__(self, model: PreTrainedModel, tree: TreeTopology | DynamicTree,
                 name: str = "draft_model", vocab_ids: torch.Tensor | None = None,
                 iid_siblings: bool = False):
        if iid_siblings and isinstance(tree, DynamicTree):
            raise TreeError("iid_siblings draws a static tree's sampled children i.i.d.; a "
                            "dynamic tree chooses its children (top-k), it draws none")
        super().__init__(model.config, tree, name)
        self.iid_siblings = iid_siblings
        self.model = model.eval()
        self.target_vocab_size = model.config.vocab_size
        self.vocab_ids = (None if vocab_ids is None
                          else check_vocab_ids(vocab_ids, self.target_vocab_size))

    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        """B new sequences, drafted together by `propose_batch`."""
        super().begin_batch(prompts)
        self.cached_rows = [torch.empty(0, dtype=torch.long) for _ in prompts]
        self.last_trees: list[TokenTree | None] = [None] * len(prompts)

    @property
    def cached(self) -> torch.Tensor:
        """(T,) the tokens the draft's cache holds (committed), for one sequence."""
        if len(self.cached_rows) != 1:
            raise ValueError(f"`cached` is for one sequence; this drafter has "
                             f"{len(self.cached_rows)}")
        return self.cached_rows[0]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` of the batch (finished ones leave)."""
        super().keep_rows(rows)
        self.cached_rows = [self.cached_rows[row] for row in rows.tolist()]
        self.last_trees = [self.last_trees[row] for row in rows.tolist()]

    def propose_batch(self, ctxs: list[DraftContext]) -> list[TokenTree]:
        """EngineDrafter.propose_batch, remembering the trees: `update_batch` commits only
        from a tree of ours."""
        self.last_trees = super().propose_batch(ctxs)
        return list(self.last_trees)

    def update_batch(self, trees: list[TokenTree], acceptances: list[Acceptance]) -> None:
        """Keep each row's draft entries of its accepted path; crop the rest of the trees. A
        row decoded without our tree (the context's end) keeps nothing of it."""
        paths = [acceptance.path if tree is ours else [0]
                 for tree, ours, acceptance in zip(trees, self.last_trees, acceptances)]
        committed = self.engine.commit(paths)
        for row, (tree, path, count) in enumerate(zip(trees, paths, committed)):
            self.cached_rows[row] = torch.cat([self.cached_rows[row],
                                               tree.tokens[path[1:1 + count]]])

    def _catch_up(self, ctxs: list[DraftContext]) -> tuple[None, torch.Tensor]:
        """Cache each row's (T_b,) committed tokens, all rows in one forward; returns no
        states (the cache is all a draft LM carries) and the draft logits (B, V') after each
        row's last token."""
        contexts, keeps = self._crop_to_common_prefix(ctxs)
        counts = [len(tokens) - keep for tokens, keep in zip(contexts, keeps)]
        if len(contexts) > 1 and self.engine.size == 0:  # the prompts: each row alone
            logits = self._start_rows(contexts)
        else:
            positions, mask = self.engine.chains(counts, self.model.dtype)
            fed = torch.zeros(positions.shape, dtype=torch.long)
            for row, (tokens, keep) in enumerate(zip(contexts, keeps)):
                fed[row, :len(tokens) - keep] = tokens[keep:]
            last = torch.tensor(counts) - 1
            keep_columns = torch.unique(last)  # only these positions go through the LM head
            out, _ = batched_forward(self.model, self.engine.cache, fed, positions, mask,
                                     logits_to_keep=keep_columns)
            self.engine.commit_chains(counts)
            column = torch.searchsorted(keep_columns, last).to(out.device)
            logits = out[torch.arange(len(contexts), device=out.device), column].cpu()
        self.cached_rows = [tokens.clone() for tokens in contexts]
        return None, logits

    def _crop_to_common_prefix(self, ctxs: list[DraftContext]
                               ) -> tuple[list[torch.Tensor], list[int]]:
        """Crop each row's cache to what it shares with its context (the cache may be ahead
        after a new sequence), but below the root, whose logits are the first level's
        distribution. Returns the (T_b,) contexts and the kept counts."""
        contexts = [ctx.tokens.cpu() for ctx in ctxs]
        keeps = [min(_common_prefix(cached, tokens), len(tokens) - 1)
                 for cached, tokens in zip(self.cached_rows, contexts)]
        self.engine.crop_rows(keeps)
        # in step with the cache, should the forward fail
        self.cached_rows = [tokens[:keep] for tokens, keep in zip(contexts, keeps)]
        return contexts, keeps

    def _start_rows(self, contexts: list[torch.Tensor]) -> torch.Tensor:
        """The first catch-up of an empty engine, row by row (DraftEngine.start_rows): each
        row's whole context. Returns the logits (B, V') after each row's last token."""
        last = []

        def run_row(row: int, cache) -> None:
            tokens = contexts[row]
            logits, _ = batched_forward(self.model, cache, tokens[None],
                                        torch.arange(len(tokens))[None], logits_to_keep=1)
            last.append(logits[0, -1].cpu())

        self.engine.start_rows([len(tokens) for tokens in contexts], run_row)
        return torch.stack(last)

    def _depth_limit(self, ctx: DraftContext) -> int:
        """The tree's depth, less near the end of the draft model's position range (a node at
        depth d sits at position T - 1 + d; GPT-2's position table would overflow)."""
        max_positions = context_window(self.model)
        if max_positions is None:
            return self.tree.depth
        return min(self.tree.depth, max_positions - len(ctx.tokens))

    def _forward_level(self, requests: dict[int, LevelRequest]) -> dict[int, LevelAnswer]:
        """One tree level of every asking row through the cache, in one forward: each node's
        token after its path. Returns no states and the nodes' float CPU draft logits
        (n_b, V') per row."""
        positions, mask = self.engine.level(
            [requests[row].paths if row in requests else [] for row in range(self.engine.rows)],
            self.model.dtype)
        tokens = torch.zeros(positions.shape, dtype=torch.long)
        for row, request in requests.items():
            tokens[row, :len(request.tokens)] = torch.tensor(request.tokens)
        logits, _ = batched_forward(self.model, self.engine.cache, tokens, positions, mask)
        return {row: (None, logits[row, :len(request.tokens)].cpu())
                for row, request in requests.items()}


def truncated_copy(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target cut to its first `num_layers` decoder layers (plus its final norm and head).

    The copy shares the target's weight tensors (no memory, no training): it is built on the
    meta device and every tensor is assigned from the target. Llama, Qwen2, GPT-2 and other
    models whose config has `num_hidden_layers` (GPT-2: an alias of n_layer).
    """
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total - 1}] for a target of {total} "
                         f"layers, got {num_layers}")
    config = shallow_config(model.config, num_layers)
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    result = draft.load_state_dict(model.state_dict(), strict=False, assign=True)
    _check_dropped_only(result.missing_keys, result.unexpected_keys, num_layers)
    # Non-persistent buffers (rotary inv_freq) are not in the state dict: share them too.
    for name, buffer in draft.named_buffers():
        if buffer.is_meta:
            module, _, attr = name.rpartition(".")
            setattr(draft.get_submodule(module), attr, model.get_buffer(name))
    return draft.eval()


def _check_dropped_only(missing: list[str], unexpected: list[str], num_layers: int) -> None:
    # Every weight of the copy must come from the target, and only the dropped layers' weights
    # may be left over; anything else means the layer list was not where the config says.
    dropped = [k for k in unexpected if (m := re.search(r"\.(\d+)\.", k))
               and int(m.group(1)) >= num_layers]
    left = sorted(set(missing) | (set(unexpected) - set(dropped)))
    if left:
        raise ValueError(f"truncating to {num_layers} layers left weights unmatched: {left[:5]}")


def check_compatible(target_model: PreTrainedModel, target_tokenizer,
                     draft_model: PreTrainedModel, draft_tokenizer) -> None:
    """Refuse a draft whose token ids mean something else than the target's (ValueError)."""
    sizes = target_model.config.vocab_size, draft_model.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(f"vocabulary sizes differ: target {sizes[0]} vs draft {sizes[1]}")
    if target_tokenizer is None and draft_tokenizer is None:
        return  # tiny random models: ids are all there is
    if target_tokenizer is None or draft_tokenizer is None:
        which = "target" if target_tokenizer is None else "draft"
        raise ValueError(f"tokenizers differ: the {which} has none")
    difference = _first_difference(target_tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    if difference:
        raise ValueError(f"tokenizers differ: {difference}")


def _first_difference(target: dict[str, int], draft: dict[str, int]) -> str | None:
    """The lowest id whose token differs between two vocabularies, described; or None."""
    by_id = [{i: t for t, i in vocab.items()} for vocab in (target, draft)]
    for i in sorted(by_id[0].keys() | by_id[1].keys()):
        if by_id[0].get(i) != by_id[1].get(i):
            return f"id {i} is {by_id[0].get(i)!r} in the target, {by_id[1].get(i)!r} in the draft"
    return None


@dataclass
class DraftModelConfig:
    """conf/drafter/draft_model.yaml, typed: the only defaults of these keys."""

    name: str = "draft_model"
    path: str | None = None  # a folder or hub id; None: the target cut to num_layers layers
    num_layers: int = 2  # the self-draft's layers; training: the distilled draft's
    # Training only (python train.py drafter=draft_model, train.draft_model):
    init: str = "truncate"  # truncate: a trainable copy of the target's first layers | fresh
    architecture: dict[str, int] | None = None  # fresh: overrides of the target's config
    draft_vocab_size: int | None = 8192  # the head's rows; null: the whole vocabulary
    divergence: str = "forward_kl"  # forward_kl | reverse_kl | tv
    allow_other_target: bool = False  # load a distilled draft whose target's fingerprint differs
    iid_siblings: bool = False  # sampling: a static tree's siblings drawn i.i.d. (rule=spectr)
    step: str | None = None  # torch | openvino; null: openvino when target.step=openvino


def draft_model_config(cfg: Mapping) -> DraftModelConfig:
    """conf/drafter/draft_model.yaml checked against DraftModelConfig."""
    return typed_config(DraftModelConfig, cfg, "draft model")


def from_config(cfg: Mapping, tree: TreeTopology | DynamicTree,
                target: Target) -> DraftModelDrafter:
    """conf/drafter/draft_model.yaml: `path: null` + `num_layers: N` drafts with the target cut
    to N layers; `path: <folder or hub id>` loads that model (a distilled draft's folder with
    its reduced vocabulary) and checks it is compatible."""
    config = draft_model_config(cfg)
    vocab_ids = None
    if config.path is None:
        model = truncated_copy(target.model, config.num_layers)
    else:
        model, vocab_ids = load_draft_model(config.path, target, config.allow_other_target)
    return DraftModelDrafter(model, tree, name=config.name, vocab_ids=vocab_ids,
                             iid_siblings=config.iid_siblings)


def load_draft_model(path: str | Path, target: Target, allow_other_target: bool = False
                     ) -> tuple[PreTrainedModel, torch.Tensor | None]:
    """The draft model in `path` (a folder or hub id) in the target's dtype, attention
    implementation and device, refused unless its token ids mean what the target's do and,
    for a draft distilled here, unless it was distilled from this target (check_target); and
    its draft vocabulary (V',) when the folder has one (its LM head is then cut to those rows).
    """
    path = pretrained_source(path, "draft model")  # a missing local path: refused here
    check_kind(path, "a draft model", MODEL_KINDS)  # not a head's weights
    distilled_here = (Path(path) / DRAFT_INFO_FILE).is_file()
    if distilled_here:
        saved = read_config(path, DRAFT_INFO_FILE)["target"]
        check_target(saved, target, path, "draft model", allow_other_target)
    # whole and causal, no folder code run
    model = load_causal_lm(path, "draft model", dtype=target.model.dtype,
                           attn_implementation=target.model.config._attn_implementation)
    # A folder saved for a tokenizer-less (tiny) target has none; a hub id always has one.
    has_tokenizer = not Path(path).is_dir() or (Path(path) / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(path, "draft model") if has_tokenizer else None
    check_compatible(target.model, target.tokenizer, model, tokenizer)
    vocab_ids = read_vocab(path)
    if vocab_ids is not None:
        model.set_output_embeddings(copy_linear(model.get_output_embeddings(), vocab_ids))
    model = model.to(target.model.device).eval()
    share_token_table(model, target.model)
    return model, vocab_ids


def share_token_table(draft: PreTrainedModel, target: PreTrainedModel) -> bool:
    """Point the draft's token embedding at the target's tensor when it holds the same values
    (a distilled draft trains with the target's frozen table): one copy in memory instead of
    two, 108 MiB on the default target. Returns whether it did."""
    ours, theirs = draft.get_input_embeddings(), target.get_input_embeddings()
    if ours.weight.shape != theirs.weight.shape or ours.weight.dtype != theirs.weight.dtype:
        return False
    if not torch.equal(ours.weight, theirs.weight.to(ours.weight.device)):
        return False
    ours.weight = theirs.weight
    return True


def read_vocab(folder: str | Path) -> torch.Tensor | None:
    """A distilled draft's vocab_ids (V',), or None when the folder has none (a hub model,
    or a draft over the whole vocabulary)."""
    path, legacy = Path(folder) / VOCAB_FILE, Path(folder) / LEGACY_VOCAB_FILE
    if path.is_file():
        ids = read_json(path, "draft vocabulary")["vocab_ids"]
        return torch.tensor(ids, dtype=torch.long)
    return load_tensors(legacy)["vocab_ids"] if legacy.is_file() else None


def save_draft_model(model: PreTrainedModel, vocab_ids: torch.Tensor | None, folder: str | Path,
                     target: Target, info: dict,
                     extra: Callable[[Path], None] | None = None, state: dict | None = None
                     ) -> None:
    """Write a distilled draft as a Hugging Face model folder (with the target's tokenizer)
    to `folder`, atomically, replacing what was there. `info` (its settings, beside the
    target's name) goes to treedraft.json; `extra(tmp)` may add files (training state);
    `state`: the model's state dict as gathered by training under fsdp.

    A reduced head (V' rows) is saved inside a full (V, H) head: the rows of vocab_ids are the
    draft's, the others the target's own when the widths agree (zeros otherwise), so
    AutoModelForCausalLM (and vLLM) load the folder as it is, drafting over all V ids;
    drafter.path= reads draft_vocab.json and keeps the V' rows only. Hugging Face's assisted
    generation and vLLM should be given a draft trained over the whole vocabulary
    (draft_vocab_size: null), whose rows are all trained.
    """
    state = model.state_dict() if state is None else state
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    head_key = head_weight_key(model)
    if vocab_ids is not None:
        target_head = target.model.get_output_embeddings().weight.detach().cpu()
        full = (target_head.clone().to(state[head_key].dtype)
                if target_head.shape[1] == state[head_key].shape[1]
                else state[head_key].new_zeros(target_head.shape[0], state[head_key].shape[1]))
        full[vocab_ids.cpu()] = state[head_key]
        state[head_key] = full
    hidden = target.model.get_output_embeddings().weight.shape[1]
    metadata = {"target": target_record(target, hidden, model.config.vocab_size), **info}

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(tmp)
        if vocab_ids is not None:
            (tmp / VOCAB_FILE).write_text(json.dumps({"vocab_ids": vocab_ids.tolist()}) + "\n")
        (tmp / DRAFT_INFO_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        if extra is not None:
            extra(tmp)

    write_atomically(Path(folder), write, overwrite=True)


def head_weight_key(model: PreTrainedModel) -> str:
    """The state-dict key of the model's LM head weight (lm_head.weight for most models)."""
    head = model.get_output_embeddings().weight
    return next(key for key, weight in model.named_parameters() if weight is head)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n
