"""Pre-packed linear weights (verify/runtime/packed.py): the packed product is used exactly at the
packed row counts and agrees with `F.linear`; the verifier pads trees up to a packed count; a
packed target decodes token for token as the unpacked one, alone and in batches."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from drafters.prompt_lookup import PromptLookupDrafter
from tests.verify.test_batch import Scripted
from verify.loop import generate, generate_batch
from verify.runtime.model import load_target
from verify.runtime.packed import (
    DEFAULT_LADDER,
    OneDNNLinear,
    PackedLinear,
    ladder_width,
    pack_linears,
    pack_target,
    packing_unavailable,
    resolve_ladder,
)
from verify.tree import TokenTree, TreeBatch, TreeTopology
from verify.verifier import TreeVerifier

needs_mkl = pytest.mark.skipif(packing_unavailable(nn.Linear(2, 2)) is not None,
                               reason="packing needs a float32 CPU torch build with MKL")


@pytest.fixture
def mkl_calls(monkeypatch):
    """Row counts of every packed product run while the test runs."""
    calls = []
    packed_product = torch.ops.mkl._mkl_linear

    def counting(x, packed, weight, bias, rows):
        calls.append(rows)
        return packed_product(x, packed, weight, bias, rows)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", counting)
    return calls


@needs_mkl
def test_packed_rows_use_the_packed_product_and_match_f_linear(mkl_calls):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert pack_linears(layer, [8, 4, 8]) == (4, 8)  # the row counts packed, sorted
    assert isinstance(layer, PackedLinear) and set(layer.packed) == {4, 8}
    assert set(layer.state_dict()) == {"weight", "bias"}  # the packed copies are not state
    for shape in [(1, 48), (2, 2, 48), (8, 48), (5, 48), (16, 48)]:
        x = torch.randn(shape)
        out = layer(x)
        assert out.shape == (*shape[:-1], 80)
        torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert mkl_calls == [4, 8]  # (2, 2, 48) is 4 rows; 1, 5 and 16 rows run unpacked
    layer.to(torch.float64)  # moved after packing: the stale packed copies are not used
    x = torch.randn(4, 48, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.double(), bias.double()))
    assert mkl_calls == [4, 8]


def test_ladder_width_pads_to_the_next_packed_row_count():
    ladder = (4, 8, 16)
    assert [ladder_width(ladder, 1, n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == \
        [1, 2, 3, 4, 8, 8, 16, 16, 17]
    # B rows: the forward multiplies B * N rows
    assert [ladder_width(ladder, 4, n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]
    assert ladder_width(ladder, 3, 1) == 1 and ladder_width(ladder, 3, 2) == 2
    assert ladder_width((), 1, 7) == 7


def test_widen_adds_padding_nodes_that_see_only_themselves():
    tree = TokenTree.from_choices(5, TreeTopology.from_choices([(0,), (1,), (0, 0)]), [6, 7, 8])
    batch = TreeBatch.pad([tree])
    wide = batch.widen(8)
    assert wide.width == 8 and batch.widen(3) is batch
    assert torch.equal(wide.tokens[0, :4], batch.tokens[0]) and wide.tokens[0, 4:].eq(0).all()
    assert wide.parents[0, 4:].eq(-1).all() and torch.equal(wide.sizes, batch.sizes)
    assert torch.equal(wide.ancestors[0, :4, :4], batch.ancestors[0])
    assert torch.equal(wide.ancestors[0, 4:, :], torch.eye(8, dtype=torch.bool)[4:])


def test_resolve_ladder_and_refusals():
    model = load_target(tiny="llama").model
    assert resolve_ladder(model, None) == () and resolve_ladder(model, []) == ()
    assert resolve_ladder(model, [8, 4]) == (8, 4)
    expected = () if packing_unavailable(model) else DEFAULT_LADDER
    assert resolve_ladder(model, "auto") == expected
    with pytest.raises(ValueError, match="'auto', 'onednn', a list"):
        resolve_ladder(model, "yes")
    half = load_target(tiny="llama", dtype="bfloat16").model
    assert resolve_ladder(half, "auto") == ()  # auto: nothing where packing cannot work
    with pytest.raises(ValueError, match="float32 weights on the CPU"):
        pack_linears(half, [8])  # asked for explicitly: an error
    with pytest.raises(ValueError, match=">= 1"):
        pack_linears(model, [0, 4])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """The same tiny target unpacked (its model) and packed for 2, 4 and 8 rows (its step)."""
    plain = load_target(tiny=request.param).model
    if packing_unavailable(plain):
        pytest.skip("packing needs a float32 CPU torch build with MKL")
    return plain, load_target(tiny=request.param, packed_rows=[2, 4, 8]).step


def prompts(*lengths):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (4,), generator=generator).repeat(n // 4 + 1)[:n]
            for n in lengths]


def lookup():
    return PromptLookupDrafter(TreeTopology.from_choices([(0,), (0, 0), (0, 0, 0), (1,), (1, 0)]))


def test_the_verifier_pads_trees_to_a_packed_count(pair, mkl_calls, monkeypatch):
    plain, packed = pair
    verifier = TreeVerifier(packed)
    verifier.prefill(torch.arange(3, 13))
    tree = TokenTree.from_choices(5, TreeTopology.chain(2), [6, 7])  # 3 nodes -> 4 rows
    fed, batch_inputs = [], verifier.state.batch_inputs  # what the step's forward is fed

    def spy(batch, lengths):
        mask, positions = batch_inputs(batch, lengths)
        fed.append((batch.tokens.shape, mask.shape, positions.shape))
        return mask, positions
    monkeypatch.setattr(verifier.state, "batch_inputs", spy)
    mkl_calls.clear()
    logits, _ = verifier.verify(tree)
    (tokens, mask, positions), = fed
    assert tokens == (1, 4) and mask[-2:] == (4, 14) and positions == (1, 4)
    assert logits.shape[0] == 3 and set(mkl_calls) == {4}  # every product of the step packed
    reference = TreeVerifier(plain)
    reference.prefill(torch.arange(3, 13))
    torch.testing.assert_close(logits, reference.verify(tree)[0], atol=1e-4, rtol=1e-4)


def test_packed_target_decodes_as_the_unpacked_one(pair, mkl_calls):
    plain, packed = pair
    rows = prompts(12, 21)
    references = {tuple(p.tolist()): generate(plain, p, 50).tokens.tolist() for p in rows}
    for prompt in rows:
        for drafter in (Scripted(references), lookup()):  # trees of 2-5 nodes; lookup's vary
            result = generate(packed, prompt, 40, drafter=drafter)
            assert result.tokens.tolist() == references[tuple(prompt.tolist())][:40]
    assert {2, 4, 8} <= set(mkl_calls)  # every packed count ran


def test_packed_target_decodes_batches_as_each_prompt_alone(pair):
    plain, packed = pair
    rows = prompts(9, 16, 5, 13)
    references = {tuple(p.tolist()): generate(plain, p, 50).tokens.tolist() for p in rows}
    batch = generate_batch(packed, rows, 40, drafter=Scripted(references))
    for prompt, result in zip(rows, batch):
        assert result.tokens.tolist() == references[tuple(prompt.tolist())][:40]
        assert result.tau > 1.3


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="bfloat16 packing needs a CPU torch build with oneDNN")


@needs_onednn
def test_bfloat16_packing_runs_every_row_count_packed(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert pack_target(layer, "onednn") == ()  # every row count packed: no tree is padded
    assert isinstance(layer, OneDNNLinear)
    assert set(layer.state_dict()) == {"weight", "bias"}
    calls = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *rest: calls.append(x.shape[0]) or product(x, *rest))
    for shape in [(1, 48), (2, 2, 48), (3, 48), (8, 48), (16, 48)]:
        x = torch.randn(shape).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight, bias))  # at this size: the same bits
    assert calls == [1, 4, 3, 8, 16]  # every row count through the packed product
    with pytest.raises(ValueError, match="float32"):
        pack_target(nn.Linear(4, 4).to(torch.bfloat16), [8])  # MKL row counts: float32 only
    with pytest.raises(ValueError, match="bfloat16 weights"):
        pack_target(nn.Linear(4, 4), "onednn")
    auto = nn.Linear(4, 4).to(torch.bfloat16)
    pack_target(auto, "auto")
    assert not isinstance(auto, OneDNNLinear)  # on request only


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_packed_bfloat16_tiny_target_gives_the_unpacked_ones_logits_and_tokens(arch):
    # tiny widths only: on the default target the packed products round differently by row
    # count (verify/runtime/packed.py), which experiments.correctness measures
    plain = load_target(tiny=arch, dtype="bfloat16").model
    packed = load_target(tiny=arch, dtype="bfloat16", packed_rows="onednn").model
    assert any(isinstance(m, OneDNNLinear) for m in packed.modules())
    tree = TokenTree.from_choices(5, TreeTopology.from_choices([(0,), (0, 0), (1,)]), [6, 7, 8])
    logits = []
    for model in (plain, packed):
        verifier = TreeVerifier(model)
        verifier.prefill(torch.arange(3, 13))
        logits.append(verifier.verify(tree)[0])
    assert torch.equal(*logits)
    for prompt in prompts(12, 21):
        expected = generate(plain, prompt, 30).tokens.tolist()
        assert generate(packed, prompt, 30).tokens.tolist() == expected
        assert generate(packed, prompt, 30, drafter=lookup()).tokens.tolist() == expected
