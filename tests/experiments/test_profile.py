"""The step profile: every part of a verification step timed, by n, on a tiny target."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from experiments.common import CONF_DIR
from experiments.profile import (
    MODEL_PARTS,
    PARTS,
    _products,
    format_products,
    format_table,
    forward_inputs,
    plot,
    product_bounds,
    product_kernels,
    product_times,
    profile,
    profile_sizes,
)
from verify.runtime.model import load_target
from verify.tree import TokenTree, TreeTopology
from verify.verifier import TreeVerifier


def profile_config(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("profile", ["target=tiny_llama", "sizes=[4,1,2]", "context_len=16",
                                   "repeats=2", "loop_steps=8", *overrides])


def test_every_part_is_timed_and_the_forward_is_split_by_module(tmp_path):
    rows = profile(profile_config("attn_implementations=[sdpa,eager]"))
    assert [(r["attn_implementation"], r["n"]) for r in rows] == [
        ("sdpa", 1), ("sdpa", 2), ("sdpa", 4), ("eager", 1), ("eager", 2), ("eager", 4)]
    for r in rows:
        assert all(r[part] >= 0 for part in PARTS) and r["loop"] >= 0
        # the hooks saw every module kind, and the split adds up to the forward
        assert all(r[part] > 0 for part in MODEL_PARTS)
        assert r["forward"] == pytest.approx(sum(r[p] for p in (*MODEL_PARTS, "model_rest")))
        assert r["step_greedy"] > r["forward"]
    assert "| eager | 4 |" in format_table(rows)
    assert plot(rows, tmp_path / "p.png").stat().st_size > 1000


def test_packings_get_their_own_rows_and_the_packed_step_is_padded():
    from verify.runtime.model import load_target
    from verify.runtime.packed import packing_unavailable

    if packing_unavailable(load_target(tiny="llama").model):
        pytest.skip("packing needs a float32 CPU torch build with MKL")
    rows = profile(profile_config("packings=[null,[2,4]]", "sizes=[1,3]"))
    assert [(r["variant"], r["n"], r["packed_rows"], r["rows_run"]) for r in rows] == [
        ("sdpa, unpacked", 1, [], 1), ("sdpa, unpacked", 3, [], 3),
        ("sdpa, packed [2, 4]", 1, [2, 4], 1), ("sdpa, packed [2, 4]", 3, [2, 4], 4)]
    assert all(r["verify"] > 0 for r in rows)
    assert "| sdpa, packed [2, 4] | 3 |" in format_table(rows)


def test_sizes_must_include_the_plain_step():
    with pytest.raises(ValueError, match="include 1"):
        profile(profile_config("sizes=[2,4]"))


def test_the_weight_products_are_timed_by_kernel_and_bound_the_step_ratio():
    model = load_target(tiny="llama").model
    kernels = product_kernels(model)
    rows = product_bounds(product_times(model, [1, 4], repeats=2), t1_ms=10.0)
    for r in rows:
        assert all(r[k] > 0 for k in kernels) and r["best"] == min(r[k] for k in kernels)
    assert rows[0]["bound"] == pytest.approx(1.0)
    assert rows[1]["bound"] == pytest.approx((10.0 - rows[0]["best"] + rows[1]["best"]) / 10)
    assert "| 4 |" in format_products(rows)
    # every kernel timed computes the model's own products
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    expected = _products("linear", weights, 4)()
    for kernel in kernels:
        for ours, theirs in zip(_products(kernel, weights, 4)(), expected, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_bfloat16_products_are_timed_with_onednn_packing_too():
    model = load_target(tiny="llama").model.to(torch.bfloat16)
    kernels = product_kernels(model)
    assert "mkl_packed" not in kernels  # MKL packs float32 only
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert "onednn_packed" in kernels
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    expected = _products("linear", weights, 4)()
    for ours, theirs in zip(_products("onednn_packed", weights, 4)(), expected, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("step, kind", [("compiled", "CompiledStep"),
                                        ("openvino", "OpenVINOStep")])
def test_a_fused_step_is_refused_by_name_and_pointed_to_step_limit(step, kind):
    target = load_target(tiny="llama", step=step)
    with pytest.raises(ValueError, match=rf"a {kind} runs neither .*experiments.step_limit"):
        profile_sizes(target.step, [1], context_len=4, repeats=1, seed=0)


@pytest.mark.parametrize("packed_rows", [None, [2, 4, 8]])
def test_the_profiled_inputs_are_what_the_verifier_feeds_the_forward(packed_rows,
                                                                      monkeypatch):
    from verify.runtime.packed import packing_unavailable

    if packed_rows and packing_unavailable(load_target(tiny="llama").model):
        pytest.skip("packing needs a float32 CPU torch build with MKL")
    verifier = TreeVerifier(load_target(tiny="llama", packed_rows=packed_rows).step)
    verifier.prefill(torch.arange(3, 13))
    tree = TokenTree.from_choices(5, TreeTopology.chain(2), [6, 7])  # 3 nodes
    tokens, mask, positions = forward_inputs(verifier, tree)
    fed, batch_inputs = [], verifier.state.batch_inputs

    def spy(batch, lengths):
        fed.append((batch.tokens, *batch_inputs(batch, lengths)))
        return fed[-1][1:]
    monkeypatch.setattr(verifier.state, "batch_inputs", spy)
    verifier.verify(tree)
    (want_tokens, want_mask, want_positions), = fed
    assert len(tokens) == (4 if packed_rows else 3)  # padded to a packed row count
    assert torch.equal(tokens, want_tokens[0]) and torch.equal(mask, want_mask)
    assert torch.equal(positions, want_positions[0])
