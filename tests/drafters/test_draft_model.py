"""The draft-model drafter: its KV cache, its children (greedy top-k and sampled without
replacement), the truncated self-draft, and the refusal of incompatible draft models."""

import copy

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

from drafters import build_drafter
from drafters.draft_model import DraftModelDrafter, check_compatible, truncated_copy
from drafters.trees.dynamic import DynamicTree
from drafters.trees.steps import propose_children
from verify.accept import Acceptance
from verify.loop import generate
from verify.protocol import DraftContext
from verify.runtime.model import Target, load_target
from verify.sampling import SamplingParams
from verify.tree import TreeTopology

ARCHS = ["llama", "qwen2", "gpt2"]
CONTEXT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])


def context(tokens, params=SamplingParams(), generator=None):
    return DraftContext(torch.as_tensor(tokens), None, params, generator)


def draft_logits(model, tokens):
    """(V,) the draft model's next-token logits after `tokens`, computed from scratch."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens)[None]).logits[0, -1]


@pytest.fixture(scope="module")
def self_draft(tiny):
    return truncated_copy(tiny("llama").model, 1)


# -- the cache ------------------------------------------------------------------------------------

def test_cache_holds_exactly_the_committed_tokens(self_draft, topology):
    drafter = DraftModelDrafter(self_draft, topology("tree16"))
    drafter.begin(CONTEXT)
    for tokens in (CONTEXT, torch.cat([CONTEXT, torch.tensor([7, 8, 9])])):
        drafter.propose(context(tokens))
        assert drafter.engine.length == len(tokens)  # the tree's entries follow until update()
        assert torch.equal(drafter.cached, tokens)


def test_cache_ahead_after_a_rejection_is_cropped(self_draft, topology):
    drafter = DraftModelDrafter(self_draft, topology("tree16"))
    drafter.begin(CONTEXT)
    drafter.propose(context(torch.cat([CONTEXT, torch.tensor([7, 8, 9])])))
    # Shares 10 of the 13 cached tokens: the cache must drop 3, not only the 2 beyond its end.
    diverged = torch.cat([CONTEXT, torch.tensor([8, 100])])
    tree = drafter.propose(context(diverged))
    fresh = DraftModelDrafter(self_draft, topology("tree16"))
    expected = fresh.propose(context(diverged))
    assert torch.equal(tree.tokens, expected.tokens)
    assert torch.equal(tree.parents, expected.parents)
    assert drafter.engine.length == len(diverged)
    for ours, theirs in zip(drafter.engine.cache.layers, fresh.engine.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys)


@pytest.mark.parametrize("path", [[0, 1, 4], [0, 2], [0, 1, 4, 7, 8]])
def test_committing_the_accepted_path_equals_re_running_it(self_draft, topology, path):
    # tree8: nodes 1, 2, 3 at depth 1; 4, 5 under 1, 6 under 2; 7 under 4; 8 under 7 (a leaf)
    drafter = DraftModelDrafter(self_draft, topology("tree8"))
    tree = drafter.propose(context(CONTEXT))
    drafter.update(tree, Acceptance(path, bonus=5))
    following = torch.cat([CONTEXT, tree.tokens[path[1:]], torch.tensor([5])])
    assert drafter.engine.length < len(following)  # nothing left to feed but what is missing
    committed = drafter.engine.length
    ours = drafter.propose(context(following))
    fresh = DraftModelDrafter(self_draft, topology("tree8"))
    theirs = fresh.propose(context(following))
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.parents, theirs.parents)
    assert committed == len(CONTEXT) + min(len(path) - 1, 3)  # the leaf at depth 4 was not fed
    for a, b in zip(drafter.engine.cache.layers, fresh.engine.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_committing_a_dynamic_trees_path_equals_re_running_it(self_draft, accepted):
    # EAGLE-2 feeds candidates the rerank may drop: the kept ones are renamed to tree ids,
    # so the accepted path's entries are kept exactly as for a static tree.
    tree_policy = DynamicTree(depth=4, top_k=3, total_tokens=6)
    drafter = DraftModelDrafter(self_draft, tree_policy)
    tree = drafter.propose(context(CONTEXT))
    path = [0]
    while len(path) <= accepted and tree.children(path[-1]):
        path.append(tree.children(path[-1])[-1])  # the last child: not always the first fed
    drafter.update(tree, Acceptance(path, bonus=5))
    following = torch.cat([CONTEXT, tree.tokens[path[1:]], torch.tensor([5])])
    ours = drafter.propose(context(following))
    fresh = DraftModelDrafter(self_draft, tree_policy)
    theirs = fresh.propose(context(following))
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.parents, theirs.parents)
    for a, b in zip(drafter.engine.cache.layers, fresh.engine.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", ["tree8", "eagle2"])
def test_a_batch_drafts_each_rows_own_tree(self_draft, topology, tree):
    # Four sequences of different lengths accept paths of different lengths (the root alone,
    # inner nodes, a leaf never fed) and one leaves: the batch's trees and committed cache
    # lengths are what each row's own drafter gets alone.
    policy = DynamicTree(depth=4, top_k=3, total_tokens=6) if tree == "eagle2" else topology(tree)
    batch = DraftModelDrafter(self_draft, policy)
    alone = [DraftModelDrafter(self_draft, policy) for _ in range(4)]
    contexts = [CONTEXT, CONTEXT[:4], torch.cat([CONTEXT, CONTEXT]), CONTEXT[2:]]
    batch.begin_batch(contexts)
    rows = [0, 1, 2, 3]
    for step, depths in enumerate([[0, 2, 1, 4], [3, 0, 2, 1], [1, 9, 0, 3]]):
        if step == 2:  # row 1 finishes
            rows.remove(1)
            batch.keep_rows(torch.tensor([0, 2, 3]))
        together = batch.propose_batch([context(contexts[row]) for row in rows])
        trees, acceptances = [], []
        for row, ours in zip(rows, together):
            theirs = alone[row].propose(context(contexts[row]))
            assert torch.equal(ours.tokens, theirs.tokens), (step, row)
            assert torch.equal(ours.parents, theirs.parents), (step, row)
            path = [0]  # down the last children, as deep as asked
            while len(path) <= depths[row] and ours.children(path[-1]):
                path.append(ours.children(path[-1])[-1])
            acceptance = Acceptance(path, bonus=5)
            alone[row].update(theirs, acceptance)
            trees.append(ours)
            acceptances.append(acceptance)
            contexts[row] = torch.cat([contexts[row], ours.tokens[path[1:]], torch.tensor([5])])
        batch.update_batch(trees, acceptances)
        assert batch.engine.lengths.tolist() == [alone[row].engine.length for row in rows]


def test_proposing_twice_on_one_context_gives_one_tree(self_draft, topology):
    drafter = DraftModelDrafter(self_draft, topology("tree8"))
    first, second = (drafter.propose(context(CONTEXT)) for _ in range(2))
    assert torch.equal(first.tokens, second.tokens)


# -- children -------------------------------------------------------------------------------------

def test_greedy_children_are_the_draft_models_top_k(self_draft):
    topology = TreeTopology.from_choices([[0], [1], [2], [0, 0], [0, 1]])
    tree = DraftModelDrafter(self_draft, topology).propose(context(CONTEXT))
    assert tree.draft_probs is None
    assert tree.tokens[1:4].tolist() == draft_logits(self_draft, CONTEXT).topk(3).indices.tolist()
    path = torch.cat([CONTEXT, tree.tokens[1:2]])
    assert tree.tokens[4:6].tolist() == draft_logits(self_draft, path).topk(2).indices.tolist()


@pytest.mark.parametrize("top_k", [0, 2])
def test_sampled_children_have_mass_and_their_distribution(self_draft, topology, top_k):
    params = SamplingParams(temperature=1.0, top_k=top_k)
    generator = torch.Generator().manual_seed(0)
    drafter = DraftModelDrafter(self_draft, topology("tree16"))  # the root wants 4 children
    tree = drafter.propose(context(CONTEXT, params, generator))
    for node in range(len(tree)):
        kids = tree.children(node)
        q = tree.draft_probs[node]
        if kids:
            torch.testing.assert_close(q.sum(), torch.tensor(1.0))
            assert all(q[tree.tokens[kid]] > 0 for kid in kids)
        else:
            assert q.sum() == 0
    assert len(tree.children(0)) == (2 if top_k == 2 else 4)


def test_gumbel_top_k_draws_in_order_without_replacement():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([propose_children(q.log(), 2, SamplingParams(1.0), generator)[0]
                          for _ in range(4000)])
    first = torch.bincount(draws[:, 0], minlength=5) / len(draws)
    # P(second = j) = sum_i q_i q_j / (1 - q_i) over i != j.
    pair = q[:, None] * q[None, :] / (1 - q[:, None])
    second = (pair - torch.diag(pair.diag())).sum(0)
    torch.testing.assert_close(first, q, atol=0.03, rtol=0)
    torch.testing.assert_close(torch.bincount(draws[:, 1], minlength=5) / len(draws), second,
                               atol=0.03, rtol=0)
    assert (draws[:, 0] != draws[:, 1]).all() and (draws != 4).all()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)],
                         ids=["greedy", "sampling"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_draft_equal_to_the_target_is_always_accepted(arch, params, tiny, topology):
    # Exercises the level-by-level tree attention: any wrong mask or position would show up as
    # a rejected draft, since the draft computes exactly what the target will.
    model = tiny(arch).model
    drafter = DraftModelDrafter(model, topology("tree16"))
    result = generate(model, CONTEXT, 31, drafter=drafter, sampling=params,
                      generator=torch.Generator().manual_seed(0))
    assert [step.accepted for step in result.steps] == [5] * 5


def test_trees_get_shallower_at_the_end_of_the_position_range(tiny):
    model = tiny("gpt2").model  # 512 learned positions: one more would be an index error
    prompt = torch.arange(500) % 256
    drafter = DraftModelDrafter(truncated_copy(model, 1), TreeTopology.chain(8))
    result = generate(model, prompt, 12, drafter=drafter)
    assert torch.equal(result.tokens, generate(model, prompt, 12).tokens)


# -- truncated_copy --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_truncated_copy_shares_the_target_weights(arch, tiny):
    target = tiny(arch).model
    draft = truncated_copy(target, 1)
    weights = target.state_dict()
    for name, tensor in draft.state_dict().items():
        assert tensor.data_ptr() == weights[name].data_ptr(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_truncated_copy_computes_what_a_manual_cut_does(arch, tiny):
    target = tiny(arch).model
    manual = copy.deepcopy(target)
    layers = manual.transformer.h if arch == "gpt2" else manual.model.layers
    del layers[1:]
    with torch.no_grad():
        expected = manual(CONTEXT[None], use_cache=False).logits
        got = truncated_copy(target, 1)(CONTEXT[None], use_cache=False).logits
    torch.testing.assert_close(got, expected)


def test_truncated_copy_keeps_tied_embeddings_tied():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, tie_word_embeddings=True)
    draft = truncated_copy(AutoModelForCausalLM.from_config(config), 2)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("num_layers", [0, 2])
def test_truncated_copy_refuses_a_layer_count_out_of_range(num_layers, tiny):
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 1\]"):
        truncated_copy(tiny("llama").model, num_layers)


# -- compatibility ---------------------------------------------------------------------------------

def tokenizer(rename: dict[int, str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over 256 tokens "t0".."t255", some renamed."""
    names = {i: f"t{i}" for i in range(256)} | (rename or {})
    vocab = {name: i for i, name in names.items()}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")))


def test_a_different_vocabulary_size_is_refused(tiny):
    other = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=300, n_embd=32, n_layer=1,
                                                        n_head=2))
    with pytest.raises(ValueError, match="vocabulary sizes differ: target 256 vs draft 300"):
        check_compatible(tiny("llama").model, None, other, None)


def test_a_different_tokenizer_is_refused(tiny):
    model = tiny("llama").model
    check_compatible(model, tokenizer(), model, tokenizer())
    with pytest.raises(ValueError, match="tokenizers differ: id 7 is 't7' in the target, 'x' in"):
        check_compatible(model, tokenizer(), model, tokenizer({7: "x"}))
    with pytest.raises(ValueError, match="tokenizers differ: the draft has none"):
        check_compatible(model, tokenizer(), model, None)


def test_a_draft_model_loaded_from_a_folder(tmp_path, conf):
    draft = load_target(tiny="llama", seed=1)
    draft.model.save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    cfg = {"name": "draft_model", "path": str(tmp_path)}
    target = Target(load_target(tiny="llama").model, tokenizer(), "tiny-llama")
    drafter = build_drafter(cfg, conf("tree", "chain4"), target)
    result = generate(target.model, CONTEXT, 20, drafter=drafter)
    assert torch.equal(result.tokens, generate(target.model, CONTEXT, 20).tokens)
    target.tokenizer = tokenizer({3: "x"})
    with pytest.raises(ValueError, match="tokenizers differ"):
        build_drafter(cfg, conf("tree", "chain4"), target)


def test_a_distilled_folder_holds_only_weights_in_safetensors_and_its_vocabulary_reads_back(
        tiny, tmp_path):
    # vLLM loads every *.safetensors file of a model folder as weights: the draft vocabulary
    # lives in JSON, and a folder saved before (draft_vocab.safetensors) still reads
    from safetensors import safe_open
    from safetensors.torch import save_file

    from drafters.draft_model import LEGACY_VOCAB_FILE, read_vocab, save_draft_model
    from drafters.vocab import copy_linear

    target = tiny("llama")
    vocab = torch.arange(3, 200, 3)
    draft = copy.deepcopy(truncated_copy(target.model, 1))
    draft.set_output_embeddings(copy_linear(draft.get_output_embeddings(), vocab))  # V' rows
    save_draft_model(draft, vocab, tmp_path / "d", target, {"num_layers": 1})
    params = set(dict(draft.named_parameters())) | {"lm_head.weight"}
    for path in (tmp_path / "d").glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            assert set(weights.keys()) <= params, path.name
    assert torch.equal(read_vocab(tmp_path / "d"), vocab)
    (tmp_path / "d" / "draft_vocab.json").unlink()
    save_file({"vocab_ids": vocab}, str(tmp_path / "d" / LEGACY_VOCAB_FILE))
    assert torch.equal(read_vocab(tmp_path / "d"), vocab)


def test_a_draft_model_with_a_sliding_window_is_refused_when_built():
    # its cache is trimmed and its entries moved like the target's: refused before decoding
    from tests.verify.test_step import tiny_mistral
    with pytest.raises(ValueError, match=r"the draft model's layers \[0, 1\] cache "
                                         r"\['DynamicSlidingWindowLayer'\]"):
        DraftModelDrafter(tiny_mistral(16), TreeTopology.chain(2))
    assert DraftModelDrafter(tiny_mistral(None), TreeTopology.chain(2)).iid_siblings is False
