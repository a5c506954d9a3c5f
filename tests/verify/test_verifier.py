"""Tree attention gives every node the logits of decoding its path sequentially; the cache
keeps exactly the accepted path."""

import pytest
import torch

from verify.runtime.hf_state import tree_attention_mask
from verify.runtime.model import load_target
from verify.tree import TokenTree, TreeBatch
from verify.verifier import TreeVerifier

ARCHS = ["llama", "qwen2", "gpt2"]
# root, two children, a grandchild under the first and one under the second, a great-grandchild
TREE_PARENTS = [-1, 0, 0, 1, 2, 3]


def tiny(arch, attn="sdpa"):
    return load_target(tiny=arch, attn_implementation=attn).model


def sequential_logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None]).logits[0, -1]


def path_tokens(tree, node):
    return tree.tokens[tree.ancestor_mask()[node]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_sequential_decoding(arch, attn):
    model = tiny(arch, attn)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (11,), generator=gen)
    tree = TokenTree(torch.randint(0, 256, (6,), generator=gen), torch.tensor(TREE_PARENTS))
    verifier = TreeVerifier(model, feature_layers=(-1,))
    verifier.prefill(prefix[:-1])
    tree.tokens[0] = prefix[-1]
    logits, hidden = verifier.verify(tree)
    assert logits.shape == (6, 256) and hidden.shape == (6, model.config.hidden_size)
    for node in range(len(tree)):
        expected = sequential_logits(model, torch.cat([prefix[:-1], path_tokens(tree, node)]))
        torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_commit_keeps_only_the_accepted_path(arch):
    model = tiny(arch)
    prefix = torch.arange(3, 12)
    tree = TokenTree(torch.tensor([12, 40, 41, 42, 43, 44]), torch.tensor(TREE_PARENTS))
    verifier = TreeVerifier(model)
    verifier.prefill(prefix)
    verifier.verify(tree)
    verifier.commit([0, 2, 4])  # tokens 12, 41, 43
    assert verifier.length == len(prefix) + 3
    assert all(layer.keys.shape[-2] == verifier.length for layer in verifier.state.cache.layers)
    # the next token sees exactly prefix + accepted path
    next_tree = TokenTree(torch.tensor([7]), torch.tensor([-1]))
    logits, _ = verifier.verify(next_tree)
    expected = sequential_logits(model, torch.cat([prefix, torch.tensor([12, 41, 43, 7])]))
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_tree_mask_shape_and_values():
    tree = TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0]))
    mask = tree_attention_mask(TreeBatch.pad([tree]), torch.tensor([2]), 2, torch.float32)
    assert mask.shape == (1, 1, 3, 5)
    blocked = mask[0, 0] < 0
    assert blocked.tolist() == [
        [False, False, False, True, True],
        [False, False, False, False, True],
        [False, False, False, True, False],
    ]
