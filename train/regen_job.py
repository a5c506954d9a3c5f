"""One conversation being regenerated, turn by turn: the prompt for its next assistant turn,
the target's answer taken in its place, and its outcome (train.regenerate drives jobs in
rounds, train.regen_continuous on a continuous batch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from jinja2.exceptions import TemplateError

from train.conversations import chat_messages
from train.regen_folder import Message, Outcome
from verify.loop import until_eos
from verify.runtime.model import Target


@dataclass
class Job:
    """One conversation being regenerated: its source messages, the messages written so far
    (the target's answers in place of the source's), and where it stands."""

    id: str
    source: list[Message]
    written: list[Message] = field(default_factory=list)
    next: int = 0  # the source message to copy or answer next
    counts: Counter = field(default_factory=Counter)
    outcome: Outcome | None = None

    @classmethod
    def start(cls, record_id: str, turns: list) -> Job:
        job = cls(record_id, chat_messages(turns))
        if not any(m["role"] == "assistant" for m in job.source):
            job.outcome = Outcome(record_id, "skipped", "empty: no assistant turn after a user "
                                  "turn")
        return job

    def next_prompt(self, target: Target, max_context_tokens: int) -> torch.Tensor | None:
        """(P,) token ids asking for the next assistant turn, or None when the job ended here
        (its outcome is set)."""
        while self.next < len(self.source) and self.source[self.next]["role"] != "assistant":
            self.written.append(self.source[self.next])
            self.next += 1
        if self.next == len(self.source):
            return self._finish()
        try:
            ids = target.tokenizer.apply_chat_template(
                self.written, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        except TemplateError as error:
            self.outcome = Outcome(self.id, "failed", f"template refused: {error.message}")
            return None
        if len(ids) > max_context_tokens:
            self.counts["dropped_turns"] = sum(m["role"] == "assistant"
                                               for m in self.source[self.next:])
            return self._finish()
        return torch.tensor(ids, dtype=torch.long)

    def answered(self, target: Target, tokens: torch.Tensor, max_new_tokens: int) -> None:
        """Take the target's answer (R,) tokens to the last prompt."""
        kept = until_eos(tokens.tolist(), target.eos_token_ids)
        self.written.append({"role": "assistant", "content": target.decode(kept).strip()})
        self.counts["answers"] += 1
        self.counts["tokens"] += len(tokens)
        self.counts["cut_answers"] += len(kept) == len(tokens) == max_new_tokens
        self.next += 1

    def _finish(self) -> None:
        """End the job: done with the messages through its last answer, or skipped when the
        first prompt was already too long."""
        while self.written and self.written[-1]["role"] != "assistant":
            self.written.pop()  # turns after the last answer teach nothing
        if not self.counts["answers"]:
            self.outcome = Outcome(self.id, "skipped", "too long: the first prompt exceeds "
                                   "regen.max_context_tokens")
        else:
            self.outcome = Outcome(self.id, "done", conversations=self.written, **self.counts)
        return None
