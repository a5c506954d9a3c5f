"""attn_implementation="sdpa_gqa" computes what "sdpa" computes, on every kind of forward the
framework runs: prefill, one-token decoding, tree verification, causal forwards over a cache."""

import pytest
import torch

from drafters.eagle import EagleDraft
from verify.loop import generate
from verify.runtime.model import build_tiny_model
from verify.tree import TokenTree
from verify.verifier import TreeVerifier

PROMPT = torch.tensor([5, 9, 17, 3, 44, 2, 8, 31, 7, 12])
TREE = TokenTree(torch.tensor([6, 10, 11, 20, 21, 22]), torch.tensor([-1, 0, 0, 1, 1, 2]))


def forwards(model):
    """Logits of a prefill, a tree, the accepted path's commit and a one-token step."""
    verifier = TreeVerifier(model, feature_layers=(1, -1))
    prefill, features = verifier.prefill(PROMPT)
    tree, tree_features = verifier.verify(TREE)
    verifier.commit([0, 1, 3])
    step, _ = verifier.verify(TokenTree(torch.tensor([4]), torch.tensor([-1])))
    return [prefill, features, tree, tree_features, step]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_sdpa_gqa_gives_sdpa_numbers(arch):
    # eval(): the tiny GPT-2 has attention dropout, random in both while training
    reference = forwards(build_tiny_model(arch, attn_implementation="sdpa").eval())
    ours = forwards(build_tiny_model(arch, attn_implementation="sdpa_gqa").eval())
    for a, b in zip(reference, ours):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_grouped_heads_are_broadcast_not_copied(monkeypatch):
    # the tiny models group 4 query heads over 2 key/value heads; sdpa_gqa must hand SDPA the
    # 2 cached heads (enable_gqa), masked tree forwards included
    model = build_tiny_model("llama", attn_implementation="sdpa_gqa")
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append((query.shape[1], key.shape[1], kwargs.get("attn_mask") is not None))
        return real(query, key, value, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    forwards(model)
    assert {(q, k) for q, k, _ in seen} == {(4, 2)}
    assert any(masked for _, _, masked in seen)  # the tree forward went through it


def test_decoding_and_a_draft_layer_run_on_it():
    model = build_tiny_model("llama", attn_implementation="sdpa_gqa")
    plain = generate(build_tiny_model("llama"), PROMPT, 12).tokens
    assert torch.equal(generate(model, PROMPT, 12).tokens, plain)
    draft = EagleDraft(model, (-1,), None, False)
    assert draft.body.config._attn_implementation == "sdpa_gqa"


def test_position_bias_is_refused():
    from verify.runtime.attention import sdpa_gqa_attention

    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="attn_implementation='sdpa'"):
        sdpa_gqa_attention(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1))
