"""Suffix decoding: the trie's matches and counts, incremental indexing, the speculation tree
grown from counts, and the shared memory (save/load, no request drafting from its own
answer)."""

import json

import pytest
import torch

from drafters.suffix import SuffixConfig, SuffixDrafter, SuffixMemory, warm_texts
from drafters.suffix_trie import ROOT, SuffixTrie
from drafters.trees.cost import StepCost
from drafters.trees.dynamic import DynamicTree
from verify.protocol import DraftContext
from verify.runtime.files import UnreadableFileError
from verify.sampling import SamplingParams

GREEDY = SamplingParams(0.0)


def context(tokens) -> DraftContext:
    return DraftContext(torch.tensor(tokens), None, GREEDY)


def test_counts_are_occurrences_of_each_substring():
    trie = SuffixTrie(max_depth=3)
    trie.add_document([1, 2, 3, 1, 2, 4])
    assert trie.counts[trie.walk([1, 2])] == 2
    assert trie.counts[trie.walk([2])] == 2 and trie.counts[trie.walk([4])] == 1
    assert trie.walk([1, 2, 3, 1]) is None  # longer than max_depth: cut
    assert trie.walk([3, 2]) is None
    # 1 2 continued with 3 once and 4 once: even shares, the first seen first
    assert trie.continuations(trie.walk([1, 2])) == [(3, trie.walk([1, 2, 3]), 0.5),
                                                     (4, trie.walk([1, 2, 4]), 0.5)]


def test_incremental_appends_index_the_same_trie_as_one_document():
    whole, pieces = SuffixTrie(4), SuffixTrie(4)
    tokens = [5, 6, 5, 6, 7, 5, 6, 5]
    whole.extend(tokens)
    for token in tokens:
        pieces.append(token)
    assert whole.children == pieces.children and whole.counts == pieces.counts


def test_documents_never_match_across_their_boundary():
    trie = SuffixTrie(4)
    trie.add_document([1, 2])
    trie.add_document([3, 4])
    assert trie.walk([2, 3]) is None and trie.walk([3, 4]) is not None


def test_the_longest_suffix_that_continued_is_matched():
    trie = SuffixTrie(6)
    trie.add_document([9, 1, 2, 3, 8, 2, 3, 7])
    node, length = trie.match([5, 1, 2, 3], max_match=4)
    assert length == 3 and node == trie.walk([1, 2, 3])
    assert trie.match([5, 1, 2, 3], max_match=2)[1] == 2  # capped
    assert trie.match([4, 4], max_match=4) == (ROOT, 0)
    assert trie.match([2, 3, 7], max_match=4) == (ROOT, 0)  # 7 ended the document: no continuation


# "1 2" occurred three times, followed by 3, 4, 3; "1 2 3" by 9 and by 6. "6 1 2" is new, so
# the longest suffix that occurred with a continuation is "1 2".
COUNTED = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 6, 1, 2]


def suffix_drafter(total_tokens=3, **config) -> SuffixDrafter:
    config = {"max_spec_factor": 10.0, "use_memory": False, **config}
    drafter = SuffixDrafter(DynamicTree(depth=4, top_k=2, total_tokens=total_tokens),
                            SuffixConfig(**config))
    drafter.begin(torch.tensor(COUNTED))
    return drafter


def test_the_speculation_grows_best_first_from_the_counts():
    tree = suffix_drafter().propose(context(COUNTED))
    # 3 (2/3) first; then 4 (1/3) ties 3's children 9 and 6 (2/3 * 1/2): the shallower first
    assert tree.tokens.tolist() == [2, 3, 4, 9] and tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.scores.tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 1 / 3])
    assert tree.draft_probs is None  # deterministic children: one-hot proposals


def test_match_length_and_probability_floor_bound_the_tree():
    short = suffix_drafter(total_tokens=16, max_spec_factor=1.0)
    assert len(short.propose(context(COUNTED))) - 1 == 2  # a 2-token match: 2 nodes
    floor = suffix_drafter(total_tokens=16, min_token_prob=0.5)
    assert floor.propose(context(COUNTED)).tokens.tolist() == [2, 3]  # 1/3 is under 0.5


def test_a_measured_cost_cuts_nodes_that_do_not_pay():
    costly = suffix_drafter(total_tokens=16)
    flat = {1: 10.0, 2: 10.0}  # and flat past 2
    costly.tree = DynamicTree(4, 2, 16, cost=StepCost({1: 10.0, 2: 10.0, 3: 10.0, 4: 30.0}))
    # two nodes cost no more than one step; a third triples it: never worth a 1/3 token
    assert costly.propose(context(COUNTED)).tokens.tolist() == [2, 3, 4]
    costly.tree = DynamicTree(4, 2, 16, cost=StepCost(flat))
    uncut = suffix_drafter(total_tokens=16).propose(context(COUNTED))
    assert len(costly.propose(context(COUNTED))) == len(uncut) > 5  # flat: every node pays


def test_the_request_trie_follows_the_context_as_it_grows():
    drafter = SuffixDrafter(DynamicTree(4, 2, 8), SuffixConfig(max_spec_factor=4,
                                                               use_memory=False))
    drafter.begin(torch.tensor([7, 8]))
    assert len(drafter.propose(context([7, 8]))) == 1  # nothing matched yet
    # tokens decided since: "7 8 9" happened, so after "7 8" comes 9
    assert drafter.propose(context([7, 8, 9, 7, 8])).tokens.tolist()[:2] == [8, 9]


def test_an_output_joins_the_memory_only_when_the_next_request_begins():
    drafter = SuffixDrafter(DynamicTree(4, 2, 8), SuffixConfig(max_spec_factor=4))
    answer = [20, 21, 22, 23, 24, 25]
    drafter.begin(torch.tensor([1, 2]))
    drafter.propose(context([1, 2, *answer]))
    assert drafter.memory.documents == []  # still decoding: its own answer is not there
    drafter.begin(torch.tensor([3, 4]))
    assert drafter.memory.documents == [answer]
    tree = drafter.propose(context([3, 4, 20, 21]))  # another prompt reaching the same words
    assert tree.tokens.tolist()[:3] == [21, 22, 23]
    drafter.forget()
    assert drafter.memory.documents == [] and drafter.memory.trie.tokens == 0


def test_a_repeated_prompt_does_not_reuse_its_own_answer_after_forget():
    # the benchmark's protocol: memory emptied before each repeat
    drafter = SuffixDrafter(DynamicTree(4, 2, 8), SuffixConfig(max_spec_factor=4))
    prompt, answer = [1, 2], [30, 31, 32, 33]
    drafter.begin(torch.tensor(prompt))
    assert len(drafter.propose(context([*prompt, 30, 31]))) == 1  # nothing to draft from
    drafter.propose(context([*prompt, *answer]))
    drafter.begin(torch.tensor(prompt))  # the same prompt again, memory kept: it copies
    assert drafter.propose(context([*prompt, 30, 31])).tokens.tolist() == [31, 32, 33]
    drafter.forget()
    drafter.begin(torch.tensor(prompt))
    assert len(drafter.propose(context([*prompt, 30, 31]))) == 1


def test_forks_share_the_memory_and_all_their_outputs_join_it():
    drafter = SuffixDrafter(DynamicTree(4, 2, 8), SuffixConfig())
    twin = drafter.fork()
    drafter.begin(torch.tensor([1]))
    twin.begin(torch.tensor([2]))  # begun in the same batch: row 0 has decoded nothing yet
    drafter.propose(context([1, 10, 11]))
    twin.propose(context([2, 12, 13]))
    drafter.begin(torch.tensor([3]))
    assert sorted(drafter.memory.documents) == [[10, 11], [12, 13]]
    assert twin.memory is drafter.memory


def test_memory_saves_and_loads_and_refuses_another_vocabulary(tmp_path):
    memory = SuffixMemory(max_depth=6)
    memory.add([1, 2, 3])
    memory.add([4, 5])
    memory.save(tmp_path / "memory.json", vocab_size=100)
    loaded = SuffixMemory(max_depth=6)
    loaded.load(tmp_path / "memory.json", vocab_size=100)
    assert loaded.documents == memory.documents
    assert loaded.trie.counts == memory.trie.counts
    with pytest.raises(ValueError, match="vocabulary of 100 tokens, this target has 50"):
        SuffixMemory(6).load(tmp_path / "memory.json", vocab_size=50)


@pytest.mark.parametrize("content", [b'{"vocab_size": 100, "documents": [[1, 2',
                                     b"\x8f\xff\x00\x9c"])
def test_an_unreadable_memory_or_warm_file_is_named(tmp_path, content):
    for name in ("memory.json", "answers.jsonl"):
        (tmp_path / name).write_bytes(content)
    with pytest.raises(UnreadableFileError, match=r"suffix memory file .*memory\.json"):
        SuffixMemory(6).load(tmp_path / "memory.json", vocab_size=100)
    with pytest.raises(UnreadableFileError, match=r"answers\.jsonl, line 1"):
        warm_texts(tmp_path / "answers.jsonl")


@pytest.mark.parametrize("documents, refused", [
    ([[1, 2], [1000, 2000, -3]], "document 1 holds 1000"), ([[5, -3]], "holds -3"),
    ([[1, True]], "holds True"), ([[1, "a"]], "holds 'a'"), ("abc", "must be a list"),
    ([7], "document 0 is not a list"), (None, "must be a list")])
def test_memory_token_ids_outside_the_vocabulary_are_refused(tmp_path, documents, refused):
    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"vocab_size": 256, "documents": documents}))
    with pytest.raises(ValueError, match=rf"memory\.json: .*{refused}"):
        SuffixMemory(6).load(path, vocab_size=256)


def test_warm_texts_reads_a_jsonl_and_names_a_bad_row(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"answer": "a b"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    assert warm_texts(path) == ["a b", "c"]
    path.write_text(json.dumps({"answer": "a"}) + "\n" + json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match="row 2 needs"):
        warm_texts(path)


def test_a_suffix_drafter_warms_from_a_file_through_the_target_tokenizer(tmp_path):
    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(word) for word in text.split()]}

    class Config:
        vocab_size = 100

    class Model:
        config = Config()

    class Target:
        tokenizer = Tokenizer()
        model = Model()

    from drafters.suffix import from_config
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"answer": "5 6 7 8"}) + "\n")
    drafter = from_config({"name": "suffix", "warm_from": str(path)}, DynamicTree(4, 2, 8),
                          Target())
    assert drafter.memory.documents == [[5, 6, 7, 8]]
    drafter.begin(torch.tensor([1]))
    drafter.propose(context([1, 9, 10, 11]))
    drafter.begin(torch.tensor([2]))
    assert drafter.memory.documents == [[5, 6, 7, 8], [9, 10, 11]]
    drafter.forget()  # a benchmark's next repeat: the warm start stays, the outputs go
    assert drafter.memory.documents == [[5, 6, 7, 8]]
    assert drafter.memory.trie.counts == from_config(
        {"name": "suffix", "warm_from": str(path)}, DynamicTree(4, 2, 8), Target()
    ).memory.trie.counts


def test_a_match_shorter_than_min_match_drafts_nothing():
    # COUNTED's longest matched suffix is "1 2": two tokens
    assert len(suffix_drafter(min_match=2).propose(context(COUNTED))) > 1
    assert len(suffix_drafter(min_match=3).propose(context(COUNTED))) == 1
    with pytest.raises(ValueError, match="1 <= min_match <= max_match"):
        suffix_drafter(min_match=13)


def test_a_requests_last_step_reaches_the_shared_memory():
    """The decoding loop's real order: propose, verify, update; after the last update no
    proposal comes, so update must index the step (its accepted path and bonus token)."""
    from verify.loop import generate
    from verify.runtime.model import load_target

    target = load_target(tiny="llama")
    drafter = SuffixDrafter(DynamicTree(4, 2, 8), SuffixConfig())
    prompt = torch.tensor([5, 6, 7])
    output = generate(target.step, prompt, 12, drafter=drafter).tokens.tolist()
    drafter.begin(torch.tensor([9]))
    assert drafter.memory.documents == [output]
