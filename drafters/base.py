"""Shared pieces of the drafters; the protocol itself lives in verify.protocol."""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import PretrainedConfig

from verify.accept import Acceptance
from verify.files import read_json, write_atomically
from verify.fingerprint import describe_difference, identity
from verify.protocol import DraftContext, Drafter
from verify.sampling import SamplingParams, warp
from verify.target import Target
from verify.tree import TokenTree, TreeBuilder, TreeError, TreeTopology

__all__ = ["CONFIG_FILE", "DraftContext", "Drafter", "StatelessBatchDrafter", "StatelessDrafter",
           "Steps", "add_children", "check_depth",
           "check_target", "fill_steps", "propose_children", "read_config",
           "relay", "run_lockstep", "run_steps", "save_module", "shallow_config",
           "target_record", "typed_config"]


CONFIG_FILE = "config.json"  # beside a trained drafter's weights: its settings and its target


def save_module(module: torch.nn.Module, folder: str | Path, weights_file: str, config: dict,
                extra: Callable[[Path], None] | None = None, state: dict | None = None) -> None:
    """Write `module`'s state dict (safetensors `weights_file`) and `config` (config.json) to
    `folder`, atomically, replacing what was there; `extra(tmp)` may add files (a training
    checkpoint's state). `state`: the state dict to write instead of `module.state_dict()`
    (training gathers a sharded module's whole tensors: train.sharding.full_state_dict)."""
    state = module.state_dict() if state is None else state
    # safetensors refuses views into larger storages: give it compact copies
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / weights_file))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if extra is not None:
            extra(tmp)

    write_atomically(Path(folder), write, overwrite=True)


def read_config(folder: str | Path, file: str = CONFIG_FILE) -> dict:
    """The config.json (or `file`) a trained drafter was saved with."""
    path = Path(folder) / file
    if not path.is_file():
        raise FileNotFoundError(f"no trained drafter in {folder} ({file} missing)")
    return read_json(path, "trained drafter config")


def target_record(target: Target, hidden_size: int, vocab_size: int) -> dict:
    """What a trained drafter records of the target it was trained on: the sizes its weights
    need and the target's fingerprint (verify.fingerprint), which loading checks."""
    return {"name": target.name, "hidden_size": hidden_size, "vocab_size": vocab_size,
            "fingerprint": target.fingerprint()}


def check_target(saved: Mapping, target: Target, folder: str | Path, what: str,
                 allow_other_target: bool = False) -> None:
    """Refuse a drafter trained on another target (ValueError naming both): other sizes
    always (its weights cannot load); another identity (name, config, weights) unless
    `allow_other_target`, for a user who knows the two compute the same. Drafters saved
    before fingerprints are checked by name."""
    vocab, hidden = target.model.get_output_embeddings().weight.shape
    trained_on = (f"the {what} in {folder} was trained on {saved['name']!r} (hidden_size "
                  f"{saved['hidden_size']}, vocab_size {saved['vocab_size']}), not on "
                  f"{target.name!r} (hidden_size {hidden}, vocab_size {vocab})")
    if (saved["hidden_size"], saved["vocab_size"]) != (hidden, vocab):
        raise ValueError(trained_on)
    have = identity(target.fingerprint())
    theirs = identity(saved["fingerprint"]) if "fingerprint" in saved else {"name": saved["name"]}
    have = {key: have[key] for key in theirs}
    if theirs != have and not allow_other_target:
        raise ValueError(f"{trained_on}: {describe_difference(theirs, have)}. Load the target "
                         "it was trained on, or set drafter.allow_other_target=true if you "
                         "know they compute the same")


def typed_config(schema: type, cfg: Mapping, what: str):
    """`cfg` (a conf/drafter mapping) merged into the dataclass `schema`, its only defaults:
    a misspelt key or a wrong type fails here, naming the known keys."""
    unknown = set(cfg) - set(schema.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {sorted(unknown)}; known: "
                         f"{sorted(schema.__dataclass_fields__)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(cfg)))


def shallow_config(config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of a model config with only its first `num_layers` decoder layers."""
    config = copy.deepcopy(config)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]  # Qwen2 checks the two agree
    config.num_hidden_layers = num_layers
    return config


def check_depth(topology: TreeTopology, max_depth: int | None, drafter: str) -> None:
    """Refuse, at construction, a tree deeper than the drafter can fill, or a dynamic tree
    from a drafter that fills static topologies only."""
    if not isinstance(topology, TreeTopology):
        raise TreeError(f"{drafter} fills static trees (conf/tree with `choices`), not "
                        f"{type(topology).__name__}: EAGLE and draft-model drafters grow "
                        "dynamic trees")
    if max_depth is not None and topology.depth > max_depth:
        raise TreeError(f"tree depth {topology.depth} exceeds what {drafter} can fill "
                        f"(at most {max_depth})")


# A tree policy written as steps: a generator that yields what it needs a draft forward for
# (a request), is sent the answer, and returns its tree. One sequence answers each request as
# it comes (`run_steps`); a batch answers every row's pending request with one forward
# (`run_lockstep`), so the same policy code drafts one row or B rows in step.
Steps = Generator[Any, Any, Any]


def fill_steps(topology: TreeTopology, root: int, root_logits: torch.Tensor, depth_limit: int,
               params: SamplingParams, generator: torch.Generator | None) -> Steps:
    """Steps filling a static topology level by level, for drafters that run a model per level.

    root_logits (V,): the draft's prediction after the root. Each level yields (builder,
    nodes): the tree so far and its newest level's nodes that have children in the topology;
    the answer is their draft logits (len(nodes), V). Returns the TokenTree. Levels past
    `depth_limit` are left out (a draft model near the end of its position range).
    """
    builder = TreeBuilder(root)
    placed = {0: 0}  # topology node -> tree node
    logits = {0: root_logits}  # tree node -> (V,) draft logits after its path
    frontier = [0]  # topology nodes whose children the next level drafts
    for depth in range(1, depth_limit + 1):
        first = len(builder)
        for node in frontier:
            add_children(builder, topology, placed, node, logits[placed[node]], params,
                         generator)
        frontier = [t for t, i in placed.items() if i >= first and topology.children(t)]
        if not frontier or depth == depth_limit:
            break
        nodes = [placed[t] for t in frontier]
        logits.update(zip(nodes, (yield builder, nodes)))
    return builder.build()


def run_steps(steps: Steps, answer: Callable[[Any], Any]) -> Any:
    """Drive one sequence's steps: each request gets answer(request); returns the result."""
    try:
        request = next(steps)
        while True:
            request = steps.send(answer(request))
    except StopIteration as done:
        return done.value


def run_lockstep(steps: Mapping[int, Steps],
                 answer: Callable[[dict[int, Any]], Mapping[int, Any]]) -> dict[int, Any]:
    """Drive several rows' steps together: each round, answer({row: request}) answers every
    row still asking at once. Returns {row: result}."""
    results, pending = {}, {}
    for row, row_steps in steps.items():
        try:
            pending[row] = next(row_steps)
        except StopIteration as done:
            results[row] = done.value
    while pending:
        answers, asking = answer(pending), {}
        for row, request in pending.items():
            try:
                asking[row] = steps[row].send(answers[row])
            except StopIteration as done:
                results[row] = done.value
        pending = asking
    return results


def relay(steps: Steps, ask: Callable[[Any], Steps]) -> Steps:
    """Steps that run `steps`, turning each of its requests into the requests of ask(request)
    (itself steps, whose result answers the original): a drafter wraps a tree policy's
    "expand these nodes" into "run the draft over these inputs"."""
    try:
        request = next(steps)
        while True:
            request = steps.send((yield from ask(request)))
    except StopIteration as done:
        return done.value


def add_children(builder: TreeBuilder, topology: TreeTopology, placed: dict[int, int], node: int,
                 logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> None:
    """Draft the children of topology node `node` (placed at tree node placed[node]) from (V,)
    draft logits, recording where each child lands in `placed`."""
    kids = topology.children(node)
    tokens, q = propose_children(logits, len(kids), params, generator)
    if q is not None:
        builder.set_draft_probs(placed[node], q)
    # Children in rank order take the proposals best first; a sampled child must be the next
    # draw without replacement, so a gap in the ranks is closed up, never skipped.
    for kid, token in zip(kids, tokens):
        placed[kid] = builder.add(placed[node], token)


def propose_children(logits: torch.Tensor, count: int, params: SamplingParams,
                     generator: torch.Generator | None = None
                     ) -> tuple[list[int], torch.Tensor | None]:
    """Up to `count` distinct child tokens from (V,) draft logits, best first.

    Greedy: the top-`count` tokens by logit, and None (deterministic children). Sampling: draws
    in order without replacement from q = warp(logits) (Gumbel-top-k), and q (V,) itself.
    Tokens with q = 0 are never proposed, so fewer than `count` may come back.
    """
    count = min(count, logits.shape[-1])
    if params.greedy:
        values, tokens = logits.float().topk(count)
        return tokens[values > float("-inf")].tolist(), None
    q = warp(logits, params)
    # Sorting log q + Gumbel noise is sequential sampling without replacement; log 0 = -inf
    # keeps tokens without mass out whatever the noise.
    # drawn where q is (a GPU draft's logits stay on it), by a generator on that device
    uniform = torch.rand(q.shape, generator=generator, device=q.device).clamp_min(
        torch.finfo(torch.float32).tiny)
    keys = q.log() - (-uniform.log()).log()
    values, tokens = keys.topk(count)
    return tokens[values > float("-inf")].tolist(), q


class StatelessDrafter(ABC):
    """The Drafter protocol's lifecycle for a drafter that keeps nothing between steps: it is
    told of a new sequence and of each acceptance, and does nothing with either; every
    sequence of a batch shares it (`fork` returns it). A subclass writes `propose`; one with
    some state of its own (suffix decoding's tries) overrides only the methods that touch it.
    Such a drafter drafts row by row in `verify.loop.generate_batch`."""

    feature_layers: tuple[int, ...] = ()  # reads no target hidden states
    target_top_k: int = 0  # asks for none of the target's predictions

    def begin(self, prompt: torch.Tensor) -> None:
        """Nothing to reset: every proposal reads its own context."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree whose root is ctx.tokens[-1]."""

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Nothing to learn: the next context holds the accepted tokens."""

    def fork(self) -> StatelessDrafter:
        """No per-sequence state: every sequence can share this drafter."""
        return self


class StatelessBatchDrafter(StatelessDrafter):
    """A StatelessDrafter that drafts a batch at once (verify.protocol.BatchDrafter), for a
    drafter whose work is cheaper for B rows together (one pass of Medusa's heads reads their
    weights once). A subclass writes `propose_batch`; one sequence is the batch of one."""

    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        """Nothing to reset for any row."""

    def propose(self, ctx: DraftContext) -> TokenTree:
        return self.propose_batch([ctx])[0]

    @abstractmethod
    def propose_batch(self, ctxs: list[DraftContext]) -> list[TokenTree]:
        """One tree per context, in order; tree b's root is ctxs[b].tokens[-1]."""

    def update_batch(self, trees: list[TokenTree], acceptances: list[Acceptance]) -> None:
        """Nothing to learn for any row."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """No per-row state to drop when rows leave the batch."""
