"""target.step=openvino (verify/runtime/openvino_step.py): a tree's logits and features on
OpenVINO's paged kernels equal the eager forward's, the accepted path is kept (compaction) and rows
leave a batch; each control (no tree mask, no compaction) fails the same check; what the
step cannot run is refused by name."""

import sys

import pytest
import torch

import verify.runtime.openvino_step as openvino_step
from verify.runtime.model import load_target
from verify.runtime.openvino_graph import UnsupportedModel
from verify.tree import TokenTree, TreeBatch
from verify.verifier import TreeVerifier

ARCHS = ["llama", "qwen2"]
# float32 kernels of another library sum in another order: ~1e-5 apart on these logits
TOLERANCE = 1e-4
PROMPT = torch.tensor([5, 9, 14, 3, 3, 27, 61, 8, 2, 40])
# root, two children of the root, a grandchild under the second child, its child
TREE = TokenTree(torch.tensor([7, 11, 13, 17, 19]), torch.tensor([-1, 0, 0, 2, 3]))


@pytest.fixture(scope="module")
def targets():
    return {arch: (load_target(tiny=arch), load_target(tiny=arch, step="openvino"))
            for arch in ARCHS}


def prefilled(target, layers=(-1, 1)):
    verifier = TreeVerifier(target.step, layers)
    verifier.prefill(PROMPT)
    return verifier


def two_steps(target):
    """Logits and features of TREE, and of a second tree after keeping the path 0, 2, 3."""
    verifier = prefilled(target)
    first = verifier.verify(TREE)
    verifier.commit([0, 2, 3])
    second = verifier.verify(TokenTree(torch.tensor([23, 29, 31]), torch.tensor([-1, 0, 0])))
    return first, second


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_and_features_equal_the_eager_forward(arch, targets):
    eager, paged = (two_steps(target) for target in targets[arch])
    for (eager_logits, eager_features), (logits, features) in zip(eager, paged):
        assert (logits - eager_logits).abs().max() < TOLERANCE
        assert (features - eager_features).abs().max() < TOLERANCE
        assert torch.equal(logits.argmax(-1), eager_logits.argmax(-1))


def test_without_the_tree_mask_the_logits_are_wrong(targets, monkeypatch):
    eager, paged = targets["llama"]
    expected, _ = prefilled(eager).verify(TREE)
    # the control: every node sees every earlier node, as a causal chain would
    monkeypatch.setattr(TokenTree, "ancestor_mask",
                        lambda tree: torch.ones(len(tree), len(tree), dtype=torch.bool).tril())
    logits, _ = prefilled(paged).verify(TREE)
    assert (logits - expected).abs().max() > 100 * TOLERANCE


def test_without_compaction_the_next_step_is_wrong(targets, monkeypatch):
    eager, paged = targets["llama"]
    _, (expected, _) = two_steps(eager)
    # the control: the accepted path's rows stay where the tree put them
    monkeypatch.setattr(openvino_step.PagedState, "_move", lambda self, sources, targets: None)
    _, (logits, _) = two_steps(paged)
    assert (logits - expected).abs().max() > 100 * TOLERANCE


def test_the_block_pool_grows_and_rows_leave_a_batch(targets, monkeypatch):
    monkeypatch.setattr(openvino_step, "MIN_BLOCKS", 1)  # every prompt outgrows the pool
    eager, paged = targets["qwen2"]
    prompts = [PROMPT, torch.arange(70) % 50, PROMPT[:4]]
    results = []
    for target in (eager, paged):
        verifier = TreeVerifier(target.step)
        verifier.prefill_batch(prompts)
        verifier.keep_rows(torch.tensor([2, 1]))  # the first row leaves; the others swap
        logits, _ = verifier.verify_batch(TreeBatch.pad([TREE, TREE]))
        results.append(logits)
    assert (results[0] - results[1]).abs().max() < TOLERANCE


def test_what_the_step_cannot_run_is_refused_by_name(monkeypatch):
    with pytest.raises(UnsupportedModel, match="gpt2"):
        load_target(tiny="gpt2", step="openvino")
    with pytest.raises(ValueError, match="target.dtype"):
        load_target(tiny="llama", step="openvino", dtype="float16")
    with pytest.raises(ValueError, match="packed_rows"):
        load_target(tiny="llama", step="openvino", packed_rows=[4, 8])
    monkeypatch.setitem(sys.modules, "verify.runtime.openvino_step", None)  # as if not installed
    with pytest.raises(ImportError, match="target.step=openvino needs the `openvino` package"):
        load_target(tiny="llama", step="openvino")


def test_bfloat16_moves_the_accepted_rows_bit_for_bit():
    # numpy shows OpenVINO's bf16 memory as float16: a move must copy bits, not values
    target = load_target(tiny="llama", step="openvino", dtype="bfloat16")
    verifier = prefilled(target)
    _, features = verifier.verify(TREE)
    assert features.dtype == torch.bfloat16
    state, start = verifier.state, len(PROMPT)
    sources = [state._where(0, start + node) for node in (0, 2, 3)]
    before = {name: _rows(tensor, sources) for name, tensor in state.blocks.items()}
    verifier.commit([0, 2, 3])
    targets = [state._where(0, start + k) for k in range(3)]
    for name, tensor in state.blocks.items():
        assert torch.equal(_rows(tensor, targets), before[name])


def _rows(tensor, slots) -> torch.Tensor:
    blocks, offsets = zip(*slots)
    return torch.from_numpy(openvino_step._raw(tensor)[list(blocks), :, list(offsets)].copy())


def test_bfloat16_keeps_far_positions_as_close_as_eager_bfloat16_does(targets, monkeypatch):
    # The rotary angles stay float32 on a bfloat16 step (verify/runtime/openvino_graph.py
    # `rotary_tables`); the control computes them from bfloat16 positions, as a graph running
    # the angle products in bfloat16 would: far positions then turn by radians.
    prompt = torch.arange(440) % 200
    reference = prefilled_far(targets["llama"][0], prompt)
    eager_bf16 = (prefilled_far(load_target(tiny="llama", dtype="bfloat16"), prompt)
                  - reference).abs().max()
    paged = load_target(tiny="llama", step="openvino", dtype="bfloat16")
    error = (prefilled_far(paged, prompt) - reference).abs().max()
    assert error < 2 * eager_bf16
    tables = openvino_step.rotary_tables
    monkeypatch.setattr(openvino_step, "rotary_tables", lambda model, positions: tables(
        model, positions.to(torch.bfloat16).float()))
    assert (prefilled_far(paged, prompt) - reference).abs().max() > 5 * eager_bf16


def prefilled_far(target, prompt) -> torch.Tensor:
    verifier = TreeVerifier(target.step)
    verifier.prefill(prompt)
    return verifier.verify(TREE)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_rotary_embedding_fuses_into_the_plugins_rope_kernel(arch, targets):
    # The graph's rotary shape is what the plugin's RoPE fusion matches: one RoPE kernel per
    # query and key projection, no split or concat left (main before: 0 RoPE, 2 splits a layer)
    _, paged = targets[arch]
    runtime = paged.step.compiled(()).get_runtime_model()
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in runtime.get_ops()]
    layers = paged.model.config.num_hidden_layers
    assert kinds.count("RoPE") == 2 * layers
    assert "Split" not in kinds


def test_decoding_on_the_step_runs_torch_on_one_thread_and_restores_it(targets, monkeypatch):
    # the plugin's thread pool and torch's, both spinning on the same cores, starve each other
    import verify.loop as loop

    _, paged = targets["llama"]
    seen, original = [], loop._step
    monkeypatch.setattr(loop, "_step", lambda *args: seen.append(torch.get_num_threads())
                        or original(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loop.generate(paged.step, PROMPT, 4)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        eager, _ = targets["llama"]
        seen.clear()
        loop.generate(eager.step, PROMPT, 4)  # a step naming none leaves torch's count alone
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(before)


def test_a_drafting_decode_runs_its_forwards_at_one_shape_and_plain_decoding_at_one_node(
        targets, monkeypatch):
    # each change of a forward's shape costs the plugin a re-preparation (2.8 ms float32,
    # 8.8 ms bfloat16 here): trees and root-only steps are padded to WIDTHS when drafting
    from drafters.base import StatelessDrafter
    from verify.loop import generate

    class Alternating(StatelessDrafter):
        """A 3-node chain every other step, the root alone between."""
        calls = 0

        def propose(self, ctx):
            self.calls += 1
            if self.calls % 2:
                return TokenTree(ctx.tokens[-1:], torch.tensor([-1]))
            return TokenTree(torch.tensor([int(ctx.tokens[-1]), 7, 8]), torch.tensor([-1, 0, 1]))

    _, paged = targets["llama"]
    widths, original = [], openvino_step.PagedState.infer

    def infer(self, rows, tokens, *args, **kwargs):
        widths.append(len(tokens))
        return original(self, rows, tokens, *args, **kwargs)
    monkeypatch.setattr(openvino_step.PagedState, "infer", infer)
    plain = generate(paged.step, PROMPT, 12)
    assert widths[1:] == [1] * (len(widths) - 1)  # after the prefill, unpadded
    widths.clear()
    out = generate(paged.step, PROMPT, 12, drafter=Alternating())
    assert torch.equal(out.tokens, plain.tokens)
    assert {step.tree_size for step in out.steps} == {1, 3}
    assert set(widths[1:]) == {4}
    # the control: without the widths, the same decode's forwards change shape every step
    widths.clear()
    monkeypatch.setattr(paged.step, "drafting_width", 1)
    monkeypatch.setattr(paged.step, "widths", ())
    generate(paged.step, PROMPT, 12, drafter=Alternating())
    assert set(widths[1:]) == {1, 3}
