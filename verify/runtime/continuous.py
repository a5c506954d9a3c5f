"""Continuous batching on a paged step: many sequences answered together, the row of one that
finished taken by the next one waiting at once, prompts prefilled in chunks beside the rows
that decode.

Why: regeneration answered turn by turn in rounds, and every row waited for the round's
longest answer (issue 59: 50 of 70 answers ran to the cap while the rest of the batch idled).
Here every forward runs each decoding row's next token plus as many prompt tokens as the
step's token budget leaves (`step_tokens`), so rows never wait for each other and a long
prompt never stalls the rows already decoding.

A sequence is keyed by its owner (a conversation). When an owner's answer is done its row
keeps its cache until the owner asks again (`submit` with the same key) or lets go
(`release`): a conversation's next turn then prefills only what its prompt does not share with
the tokens already cached (their longest common prefix), which is exact, since a slot's key and
value depend only on the tokens up to it.

A state made with feature layers (`step.new_state(layers)`) hands back every fed token's
hidden states too: each row keeps them beside its cached tokens, so a sequence's features come
from the forwards that answered it, and `submit(..., max_new_tokens=0)` only feeds a sequence
(the conversation as training will read it) to complete them, reusing the shared prefix.

Each answer is what decoding its prompt alone gives: greedy takes the argmax of its own row's
logits, and sampling draws from the row's own generator, so an answer does not depend on
which other sequences shared its forwards (up to the kernels' rounding across row counts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from verify.sampling import SamplingParams, sample, warp


@dataclass
class _Row:
    """One owner's row of the paged cache and the answer in progress on it."""

    index: int  # the PagedState row
    cached: list[int] = field(default_factory=list)  # token ids whose keys/values it holds
    pending: list[int] = field(default_factory=list)  # tokens still to feed, in order
    answer: list[int] | None = None  # None while its prompt is prefilled
    generator: torch.Generator | None = None
    max_new_tokens: int = 0  # this request's; 0: feed the prompt only
    features: list[torch.Tensor] = field(default_factory=list)  # (n, F * H) chunks of `cached`

    def keep(self, length: int) -> None:
        """Keep the first `length` cached tokens (and their features)."""
        self.cached = self.cached[:length]
        kept, total = [], 0
        for chunk in self.features:
            if total >= length:
                break
            kept.append(chunk[:length - total])
            total += len(kept[-1])
        self.features = kept


class ContinuousBatcher:
    """Answers to (P,) prompts on a paged state (verify.runtime.openvino_step.PagedState, or one
    with its `infer`, `logits`, `new_row`, `clear_row` and `truncate_row`), up to `max_rows`
    at once.

    Each `step()` is one forward of every decoding row's last token and, within `step_tokens`
    tokens in all, chunks of the prompts waiting to be prefilled (oldest first); it returns
    the answers that finished: `(key, tokens (R,))`, the stop token included when one ended
    the answer, at most `max_new_tokens` tokens (empty for a prompt-only request).
    """

    def __init__(self, state, *, max_rows: int,
                 max_new_tokens: int, stop: Sequence[int] = (),
                 sampling: SamplingParams = SamplingParams(), step_tokens: int = 256):
        if not 0 < max_rows < step_tokens:
            raise ValueError(f"max_rows must be in 1 .. step_tokens - 1 (a forward must leave "
                             f"room for prompts), got {max_rows} and {step_tokens}")
        self.state = state
        self.max_rows, self.max_new_tokens = max_rows, max_new_tokens
        self.stop, self.sampling, self.step_tokens = frozenset(stop), sampling, step_tokens
        self.rows: dict[Hashable, _Row] = {}  # every owner holding a row, answering or not
        self.waiting: deque[Hashable] = deque()  # owners asked, not yet answering
        self.answering: list[Hashable] = []  # owners whose answers are in progress
        self.spare: list[int] = []  # PagedState rows no owner holds
        self.fed = 0  # tokens run through the step so far (prompts and answers)

    def busy(self) -> bool:
        return bool(self.waiting or self.answering)

    def submit(self, key: Hashable, prompt: torch.Tensor,
               generator: torch.Generator | None = None,
               max_new_tokens: int | None = None) -> None:
        """Ask for an answer to `prompt` (P,) for `key`, of at most `max_new_tokens` (None:
        the batcher's; 0: none, the prompt is only fed, for its features). A key holding a
        row from an earlier request keeps the cached prefix it shares with the prompt."""
        if len(prompt) == 0:
            raise ValueError(f"an empty prompt for {key!r}")
        if key in self.waiting or key in self.answering:
            raise ValueError(f"{key!r} is already waiting for an answer")
        row = self.rows.get(key) or self._new_row(key)
        ids = prompt.tolist()
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        keep = _common_prefix(row.cached, ids)
        if limit > 0:
            keep = min(keep, len(ids) - 1)  # the last prompt token is fed for its logits
        row.keep(keep)
        self.state.truncate_row(row.index, keep)
        row.pending, row.answer, row.generator = ids[keep:], None, generator
        row.max_new_tokens = limit
        self.waiting.append(key)

    def features(self, key: Hashable) -> torch.Tensor:
        """(T, F * H) hidden states of the tokens `key`'s row holds, from the forwards that
        fed them (a state made with feature layers)."""
        return torch.cat(self.rows[key].features)

    def release(self, key: Hashable) -> None:
        """`key` asks no more: its row's blocks go back to the pool."""
        row = self.rows.pop(key, None)
        if row is not None:
            self.state.clear_row(row.index)
            self.spare.append(row.index)

    def step(self) -> list[tuple[Hashable, torch.Tensor]]:
        """One forward (see the class docstring); nothing to do returns []."""
        self._admit()
        finished = self._fed_already()
        work = self._work()
        if not work:
            return finished
        sizes = [n for _, n in work]
        ends = np.cumsum(sizes) - 1
        rows = [self.rows[key] for key, _ in work]
        tokens = torch.tensor([t for row, n in zip(rows, sizes) for t in row.pending[:n]])
        # logits only where a next token is due: rows whose prompt (or last token) is all fed
        due = [i for i, (row, n) in enumerate(zip(rows, sizes))
               if n == len(row.pending) and row.max_new_tokens > 0]
        self.state.infer([row.index for row in rows], tokens, [len(row.cached) for row in rows],
                         [torch.arange(n) for n in sizes],
                         [np.tril(np.ones((n, n), dtype=np.uint8)) for n in sizes], ends[due])
        self.fed += len(tokens)
        states = self.state.features()
        for row, n, chunk in zip(rows, sizes, [None] * len(rows) if states is None
                                 else states.split(sizes)):
            row.cached += row.pending[:n]
            row.pending = row.pending[n:]
            if chunk is not None:
                row.features.append(chunk)
        logits = self.state.logits() if due else None
        return finished + self._advance([work[i][0] for i in due], logits)

    def _fed_already(self) -> list[tuple[Hashable, torch.Tensor]]:
        """Prompt-only requests with nothing left to feed: done, with an empty answer."""
        done = [key for key in self.answering
                if self.rows[key].max_new_tokens == 0 and not self.rows[key].pending]
        for key in done:
            self.answering.remove(key)
        return [(key, torch.empty(0, dtype=torch.long)) for key in done]

    def _admit(self) -> None:
        """Waiting owners start answering while rows are free."""
        while self.waiting and len(self.answering) < self.max_rows:
            self.answering.append(self.waiting.popleft())

    def _work(self) -> list[tuple[Hashable, int]]:
        """(owner, tokens to feed) for this forward: every decoding row's one token, then
        prompt chunks, oldest first, within the step's token budget."""
        decoding = [(key, 1) for key in self.answering if self.rows[key].answer is not None]
        budget = self.step_tokens - len(decoding)
        prefilling = []
        for key in self.answering:
            row = self.rows[key]
            if row.answer is None and row.pending and budget > 0:
                n = min(len(row.pending), budget)
                prefilling.append((key, n))
                budget -= n
        return decoding + prefilling

    def _advance(self, keys: list[Hashable], logits: torch.Tensor
                 ) -> list[tuple[Hashable, torch.Tensor]]:
        """Each of `keys` takes its next token from its (V,) row of `logits`; the answers that
        ended."""
        if not keys:
            return []
        if self.sampling.greedy:
            chosen = logits.argmax(-1).tolist()
        else:
            probs = warp(logits, self.sampling)
            chosen = [sample(p, self.rows[key].generator) for key, p in zip(keys, probs)]
        finished = []
        for key, token in zip(keys, chosen):
            row = self.rows[key]
            row.answer = [*(row.answer or []), token]
            row.pending = [token]
            if token in self.stop or len(row.answer) >= row.max_new_tokens:
                row.pending = []
                self.answering.remove(key)
                finished.append((key, torch.tensor(row.answer)))
        return finished

    def _new_row(self, key: Hashable) -> _Row:
        index = self.spare.pop() if self.spare else self.state.new_row()
        self.rows[key] = _Row(index)
        return self.rows[key]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
