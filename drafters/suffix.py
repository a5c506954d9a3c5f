"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): drafts from counted continuations.

Two suffix tries (drafters.suffix_trie) answer each step: one over the request itself (its
prompt and the tokens decided so far, extended as they come) and one over earlier requests'
outputs (shared by every request this drafter and its forks decode). In each, the longest
suffix of the context that occurred before with a continuation is matched (at most
`max_match` tokens), and a speculation tree grows greedily below it: the candidate with the
highest estimated acceptance (the product of its path's continuation shares) joins next,
while it is at least `min_token_prob`, until the tree holds min(tree.total_tokens,
max_spec_factor * match length + max_spec_offset) nodes. Longer matches earn larger trees: they
predict better. The trie whose tree expects more accepted tokens proposes.

No model and no weights; children are chosen deterministically (draft_probs None: one-hot
proposals), so greedy and sampled decoding stay exact.

Memory and fairness: a request's output (its last step included: `update`) joins the
shared trie only when the next request begins, so no request ever drafts from its own answer;
`forget()` takes the shared trie back to what it was warmed with (a benchmark calls it
between repeats); `warm_from` and `memory_file` warm it from other text.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from drafters.base import StatelessDrafter
from drafters.config import typed_config
from drafters.suffix_trie import SuffixTrie
from drafters.trees.cost import cut_to_cost
from drafters.trees.dynamic import DynamicTree
from verify.accept import Acceptance
from verify.protocol import DraftContext, Resettable
from verify.runtime.files import read_json, read_jsonl, write_json
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeError


@dataclass
class SuffixConfig:
    """conf/drafter/suffix.yaml, typed: the only defaults of these keys."""

    name: str = "suffix"
    max_match: int = 12  # longest context suffix matched
    min_match: int = 1  # a shorter match drafts nothing (SAM-Decoding's switch to another drafter)
    max_spec_factor: float = 1.0  # tree nodes <= factor * match length + offset
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # candidates estimated below this are never drafted
    use_memory: bool = True  # also draft from earlier requests' outputs
    memory_file: str | None = None  # load the shared trie's documents from this JSON
    warm_from: str | None = None  # JSONL whose "text" (or "answer") fields warm the shared trie


@dataclass(frozen=True)
class Speculation:
    """A drafted tree and its expected accepted tokens (the sum of its nodes' scores)."""

    tree: TokenTree
    expected: float
    match_length: int


class SuffixMemory:
    """The shared trie over earlier outputs, with its documents (to save, reload, forget).
    The documents it was warmed with (`mark_warm`) survive `forget`: only what it learned
    from outputs since is dropped."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.documents: list[list[int]] = []
        self.warm_count = 0  # the first documents are the warm start
        self.trie = SuffixTrie(max_depth)

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) > 1:  # one token has no continuation to teach
            self.documents.append([int(t) for t in tokens])
            self.trie.add_document(tokens)

    def mark_warm(self) -> None:
        """Keep every document so far (a warm start) through `forget`."""
        self.warm_count = len(self.documents)

    def forget(self) -> None:
        """Back to the warm start: outputs learned since are dropped."""
        warm, self.documents = self.documents[:self.warm_count], []
        self.trie = SuffixTrie(self.max_depth)
        for document in warm:
            self.add(document)

    def save(self, path: str | Path, vocab_size: int) -> None:
        """Write the documents as JSON (atomically), naming the vocabulary they index."""
        write_json(Path(path), {"vocab_size": vocab_size, "documents": self.documents})

    def load(self, path: str | Path, vocab_size: int) -> None:
        """Add the documents of a `save`d file; refuse one made for another vocabulary, or
        whose documents are not lists of this vocabulary's token ids (an id past it would be
        proposed and crash the target's embedding lookup)."""
        data = read_json(path, "suffix memory")
        if data.get("vocab_size") != vocab_size:
            raise ValueError(f"{path} indexes a vocabulary of {data.get('vocab_size')} tokens, "
                             f"this target has {vocab_size}: it was saved for another tokenizer")
        for document in _checked_documents(data.get("documents"), vocab_size, path):
            self.add(document)


def _checked_documents(documents: object, vocab_size: int, source: str | Path
                      ) -> list[list[int]]:
    """`documents` when it is a list of lists of token ids in [0, vocab_size); ValueError
    naming `source`, the document and the first id that is not."""
    if not isinstance(documents, list):
        raise ValueError(f'{source}: "documents" must be a list of token-id lists, got '
                         f"{type(documents).__name__} {documents!r:.40}")
    for number, document in enumerate(documents):
        if not isinstance(document, list):
            raise ValueError(f"{source}: document {number} is not a list of token ids: "
                             f"{document!r:.40}")
        bad = [t for t in document if type(t) is not int or not 0 <= t < vocab_size]
        if bad:  # type(t): a JSON true is a Python int too
            raise ValueError(f"{source}: document {number} holds {bad[0]!r}, not a token id "
                             f"of this target's vocabulary [0, {vocab_size})")
    return documents


class _Request:
    """One request's own trie and how much of its context it has indexed."""

    def __init__(self, prompt: Sequence[int], max_depth: int):
        self.prompt_length = len(prompt)
        self.tokens: list[int] = [int(t) for t in prompt]
        self.trie = SuffixTrie(max_depth)
        self.trie.extend(self.tokens)

    def sync(self, context: torch.Tensor) -> None:
        """Index the context's tokens not seen yet (those no `update` told of)."""
        self.extend(context[len(self.tokens):].tolist())

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.trie.extend(tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_length:]


class SuffixDrafter(StatelessDrafter, Resettable):
    """Proposes the better of the request's and the shared trie's speculations. Its state is
    the open requests and the shared trie (`begin`, `fork`); `update` indexes each step's
    decided tokens into the request, so its output is whole when it joins the shared trie
    (a request's last step is followed by no proposal)."""

    def __init__(self, tree: DynamicTree, config: SuffixConfig = SuffixConfig(),
                 memory: SuffixMemory | None = None):
        if not isinstance(tree, DynamicTree):
            raise TreeError(f"{config.name} grows its own trees: give it a dynamic tree config "
                            "(depth, top_k, total_tokens: conf/tree/suffix.yaml), not a static "
                            "topology")
        if config.max_match < 1 or not 0 < config.min_token_prob <= 1:
            raise ValueError(f"need max_match >= 1 and 0 < min_token_prob <= 1, got "
                             f"{config.max_match} and {config.min_token_prob}")
        if not 1 <= config.min_match <= config.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {config.min_match} and "
                             f"{config.max_match}")
        self.tree, self.config, self.name = tree, config, config.name
        self.trie_depth = config.max_match + tree.depth
        self.memory = memory if memory is not None else SuffixMemory(self.trie_depth)
        self._open: list[_Request] = []  # this drafter's and its forks' requests, shared
        self.request: _Request | None = None

    def begin(self, prompt: torch.Tensor) -> None:
        """A new request: finished requests' outputs join the shared trie first."""
        self._close_finished()
        self.request = _Request(prompt.tolist(), self.trie_depth)
        self._open.append(self.request)

    def propose(self, ctx: DraftContext) -> TokenTree:
        if self.request is None:
            raise ValueError(f"{self.name}: call begin() before propose()")
        self.request.sync(ctx.tokens.cpu())
        context = self.request.tokens
        best = self.speculate(self.request.trie, context)
        if self.config.use_memory and self.memory.trie.tokens:
            other = self.speculate(self.memory.trie, context)
            if other.expected > best.expected:
                best = other
        return best.tree

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """The step's decided tokens (the accepted path, then the bonus token) join the
        request. A hybrid hands over the part on this drafter's own tree, a prefix of them:
        the next proposal's context adds the rest (`sync`)."""
        if self.request is not None:
            self.request.extend([int(tree.tokens[node]) for node in acceptance.path[1:]]
                                + [int(acceptance.bonus)])

    def fork(self) -> SuffixDrafter:
        """Another sequence's drafter: its own request, the same shared trie."""
        twin = SuffixDrafter(self.tree, self.config, self.memory)
        twin._open = self._open
        return twin

    def forget(self) -> None:
        """Take the shared trie back to its warm start and drop every open request (a
        benchmark's repeats start alike)."""
        self.memory.forget()
        self._open.clear()
        self.request = None

    def speculate(self, trie: SuffixTrie, context: Sequence[int]) -> Speculation:
        """The speculation tree below the longest match of `context`'s suffix in `trie`."""
        node, length = trie.match(context, self.config.max_match)
        size = min(self.tree.total_tokens,
                   math.floor(self.config.max_spec_factor * length + self.config.max_spec_offset))
        root = context[-1]
        if length < self.config.min_match or size < 1:
            return Speculation(TokenTree([root], [-1], scores=torch.ones(1)), 0.0, length)
        tokens, parents, scores = self._grow(trie, node, root, size)
        tree = TokenTree(tokens, parents, scores=torch.tensor(scores, dtype=torch.float64))
        if self.tree.cost is not None:
            tree = cut_to_cost(tree, self.tree.cost)
        return Speculation(tree, float(tree.scores[1:].sum()), length)

    def _grow(self, trie: SuffixTrie, match: int, root: int, size: int
              ) -> tuple[list[int], list[int], list[float]]:
        """Best-first growth below trie node `match`: at most `size` nodes, top_k children
        per node, tree.depth levels, none under min_token_prob."""
        tokens, parents, scores, depths = [root], [-1], [1.0], [0]
        # (-score, order, trie node, parent, token); the push order breaks ties: shallower
        # first, then more frequent
        heap: list[tuple[float, int, int, int, int]] = []
        order = itertools.count()
        self._push_children(heap, order, trie, match, 0, 1.0)
        while heap and len(tokens) <= size:
            negative, _, node, parent, token = heapq.heappop(heap)
            if -negative < self.config.min_token_prob:
                break  # the heap's best is below the floor: so is everything left
            tokens.append(token)
            parents.append(parent)
            scores.append(-negative)
            depths.append(depths[parent] + 1)
            if depths[-1] < self.tree.depth:
                self._push_children(heap, order, trie, node, len(tokens) - 1, -negative)
        return tokens, parents, scores

    def _push_children(self, heap: list, order: Iterator[int], trie: SuffixTrie, node: int,
                       parent: int, score: float) -> None:
        for token, child, share in trie.continuations(node)[: self.tree.top_k]:
            heapq.heappush(heap, (-score * share, next(order), child, parent, token))

    def save_memory(self, path: str | Path, vocab_size: int) -> None:
        """Write the shared trie's documents to `path` (reload with memory_file=)."""
        self.memory.save(path, vocab_size)

    def _close_finished(self) -> None:
        """Move the outputs of requests that decoded something into the shared trie; a request
        is finished once any request of its drafter family begins again."""
        still_open = []
        for request in self._open:
            if request.output:
                self.memory.add(request.output)
            else:  # a fork's request begun in the same batch: not decoded yet
                still_open.append(request)
        self._open[:] = still_open


def warm_texts(path: str | Path) -> list[str]:
    """The "text" (or "answer", "output") field of each row of a JSONL file."""
    texts = []
    for number, record in enumerate(read_jsonl(Path(path)), start=1):
        text = next((record[k] for k in ("text", "answer", "output") if k in record), None)
        if not isinstance(text, str):
            raise ValueError(f'{path}: row {number} needs a "text", "answer" or "output" string')
        texts.append(text)
    return texts


def warm_token_ids(path: str | Path, target: Target) -> list[list[int]]:
    """The token ids of each warm-up text of `path` (warm_texts), by the target's tokenizer;
    a target without one (a tiny random model) is refused, naming the setting."""
    if target.tokenizer is None:
        raise ValueError(f"warm_from={path}: target {target.name} has no tokenizer to read "
                         "text with; warm it from a saved memory_file= instead")
    return [target.tokenizer(text, add_special_tokens=False)["input_ids"]
            for text in warm_texts(path)]


class SharedMemory(Protocol):
    """A drafter's memory shared across requests (SuffixMemory, recycling's RecyclingTable)."""

    def load(self, path: str | Path, vocab_size: int) -> None: ...

    def mark_warm(self) -> None: ...


def warm_start(memory: SharedMemory, target: Target, memory_file: str | None,
               warm_from: str | None, read: Callable[[list[list[int]]], None]) -> None:
    """Warm a shared memory (the drafter's `memory_file` and `warm_from` settings): load the
    saved `memory_file`, then hand `read` the token ids of the `warm_from` texts
    (warm_token_ids); what it holds then is the warm start `forget` goes back to (mark_warm)."""
    if memory_file:
        memory.load(memory_file, target.model.config.vocab_size)
    if warm_from:
        read(warm_token_ids(warm_from, target))
    memory.mark_warm()


def from_config(cfg: Mapping, tree: DynamicTree, target: Target) -> SuffixDrafter:
    """conf/drafter/suffix.yaml; the target's tokenizer warms the shared trie from text."""
    config: SuffixConfig = typed_config(SuffixConfig, cfg, "suffix")
    drafter = SuffixDrafter(tree, config)

    def read(texts: list[list[int]]) -> None:
        for ids in texts:
            drafter.memory.add(ids)

    warm_start(drafter.memory, target, config.memory_file, config.warm_from, read)
    return drafter
