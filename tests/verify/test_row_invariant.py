"""attn_implementation="row_invariant": the numbers of "sdpa" in float32, and in bfloat16 with
padded steps a tree node's logits bit for bit those of the same token decoded alone."""

import pytest
import torch

from tests.verify.test_attention import forwards
from verify.loop import generate
from verify.runtime.model import build_tiny_model
from verify.tree import TokenTree, TreeBatch
from verify.verifier import TreeVerifier

PROMPT = torch.tensor([5, 9, 17, 3, 44, 2, 8, 31, 7, 12, 90, 4])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_row_invariant_gives_sdpa_numbers(arch):
    reference = forwards(build_tiny_model(arch, attn_implementation="sdpa").eval())
    ours = forwards(build_tiny_model(arch, attn_implementation="row_invariant").eval())
    for a, b in zip(reference, ours):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)


def step_logits(model, committed, tree):
    """Logits of `tree`'s rows after `committed` tokens, in one 8-row padded forward."""
    verifier = TreeVerifier(model)
    verifier.prefill(committed)
    logits, _ = verifier.verify_batch(TreeBatch.pad([tree], 8))
    return logits[0]


@pytest.mark.parametrize("attn, invariant", [("row_invariant", True), ("sdpa", False)])
def test_a_tree_node_rounds_as_the_same_token_alone_in_bfloat16(attn, invariant):
    # seed 1: a tiny model on which SDPA's node and lone token do round apart (the control)
    model = build_tiny_model("llama", attn_implementation=attn, seed=1).to(torch.bfloat16)
    prefix, a, b = PROMPT[:-2], int(PROMPT[-2]), int(PROMPT[-1])
    # node 2 (token b under a) against b decoded alone after prefix + a; node 1 a sibling
    tree = step_logits(model, prefix, TokenTree(torch.tensor([a, 77, b]),
                                                torch.tensor([-1, 0, 0])))[2]
    alone = step_logits(model, torch.cat([prefix, torch.tensor([a])]),
                        TokenTree(torch.tensor([b]), torch.tensor([-1])))[0]
    assert torch.equal(tree, alone) == invariant
    torch.testing.assert_close(tree, alone, rtol=0.05, atol=0.1)  # apart by rounding only


def test_bfloat16_greedy_decoding_is_identical_with_padded_invariant_steps():
    model = build_tiny_model("llama", attn_implementation="row_invariant").to(torch.bfloat16)

    class Repeat:  # drafts the last 3 tokens again, twice: mostly wrong, sometimes right
        feature_layers = ()
        target_top_k = 0

        def begin(self, prompt):
            pass

        def propose(self, ctx):
            tail = ctx.tokens[-3:].tolist()
            return TokenTree.from_paths(int(ctx.tokens[-1]), [tail, tail[1:]])

        def update(self, tree, acceptance):
            pass

    plain = generate(model, PROMPT, 40, pad_rows=8).tokens
    assert torch.equal(generate(model, PROMPT, 40, drafter=Repeat(), pad_rows=8).tokens, plain)
