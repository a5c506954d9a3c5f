"""target.step=compiled: the decoding step through torch.compile over preallocated room gives
the eager step's logits (float32, within rounding), the same greedy tokens, trees that equal
one-token decoding on the same step, and a room cache that keeps exactly what it should
through commits, growth and finished rows, without compiling again for any of them."""

import pytest
import torch

from drafters.prompt_lookup import PromptLookupDrafter
from verify.loop import generate, generate_batch
from verify.runtime.cache import CAPACITY_STEP, RoomLayer, room_cache, room_for
from verify.runtime.compiled import MAX_GRAPHS, compiling, graph_key
from verify.runtime.model import load_target
from verify.tree import TokenTree, TreeTopology
from verify.verifier import TreeVerifier

# float32: compiled kernels fuse and reorder the eager ones' sums; the logits agree to rounding
TOLERANCE = dict(atol=1e-4, rtol=1e-4)
PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])
TREE = TokenTree(torch.tensor([41, 42, 43, 44, 40, 42]), torch.tensor([-1, 0, 0, 1, 2, 3]))
# dynamo's settings before any compiled step is built: a step changes them for its calls only
DYNAMO_CONFIG = torch._dynamo.config.get_config_copy()


@pytest.fixture(scope="module")
def eager():
    return load_target(tiny="llama").model


@pytest.fixture(scope="module")
def compiled():
    return load_target(tiny="llama", step="compiled").step


def test_step_logits_and_features_equal_the_eager_step(eager, compiled):
    outputs = []
    for model in (eager, compiled):
        verifier = TreeVerifier(model, feature_layers=(-1,))
        prefill_logits, _ = verifier.prefill(PROMPT)
        tree_logits, features = verifier.verify(TREE)
        verifier.commit([0, 1, 3])
        plain_logits, _ = verifier.verify(TokenTree(torch.tensor([7]), torch.tensor([-1])))
        outputs.append((prefill_logits, tree_logits, features, plain_logits))
    assert TreeVerifier(compiled).step is compiled
    for eager_out, compiled_out in zip(*outputs):
        torch.testing.assert_close(compiled_out, eager_out, **TOLERANCE)


def test_greedy_decoding_through_room_growth_equals_eager_without_compiling_again(compiled,
                                                                               eager):
    from torch._dynamo.utils import counters

    # 250 prompt tokens + 40 new ones pass the first room of 256 slots: the cache grows
    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(1))
    expected = generate(eager, prompt, 40).tokens
    generate(compiled, prompt[:5], 2)  # the graphs of one-row decoding, compiled up front
    assert {graph_key(1, 1, False), graph_key(1, 2, False)} <= set(compiled.compile_s)
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(generate(compiled, prompt, 40).tokens, expected)
    # a larger room (and every tree width) is a symbolic size: nothing was compiled for it
    assert counters["stats"]["unique_graphs"] == graphs
    # the step built and run, the process's own dynamo settings are as they were
    assert torch._dynamo.config.get_config_copy() == DYNAMO_CONFIG


def test_a_compiled_steps_settings_hold_inside_its_calls_only():
    config, freezing = torch._dynamo.config, torch._inductor.config.freezing
    with compiling(freezing=True):
        assert config.recompile_limit >= MAX_GRAPHS and not config.automatic_dynamic_shapes
        assert torch._inductor.config.freezing
    assert config.get_config_copy() == DYNAMO_CONFIG
    assert torch._inductor.config.freezing == freezing


def test_trees_equal_one_token_decoding_on_the_compiled_step(compiled):
    plain = generate(compiled, PROMPT, 60).tokens
    drafter = PromptLookupDrafter(TreeTopology.from_choices([[0], [1], [0, 0], [0, 0, 0]]),
                                  min_ngram=1)
    result = generate(compiled, PROMPT, 60, drafter=drafter)
    assert torch.equal(result.tokens, plain)
    assert result.tau > 1  # trees were verified and accepted, not only lone roots


def test_a_batch_whose_rows_finish_early_equals_each_row_alone(compiled):
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:]]
    alone = [generate(compiled, p, 30).tokens for p in prompts]
    # an EOS id that some rows produce: they leave the batch, which narrows the room's rows
    eos = int(alone[1][5])
    expected = [generate(compiled, p, 30, eos_token_id=eos).tokens for p in prompts]
    rows = generate_batch(compiled, prompts, 30, eos_token_id=eos,
                          drafter=PromptLookupDrafter(TreeTopology.chain(3), min_ngram=1))
    assert len({len(r.tokens) for r in rows}) > 1  # rows did finish at different steps
    for row, want in zip(rows, expected):
        assert torch.equal(row.tokens, want)


def test_room_layer_moves_keep_the_accepted_entries():
    keys = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2)
    from transformers import DynamicCache

    dynamic = DynamicCache()
    dynamic.update(keys, keys + 100, 0)
    cache = room_cache(dynamic, room_for(5))
    layer = cache.layers[0]
    assert isinstance(layer, RoomLayer) and layer.keys.shape == (2, 1, CAPACITY_STEP, 2)
    assert layer.length == 5 and torch.equal(layer.keys[:, :, :5], keys)
    layer.grow(2 * CAPACITY_STEP)
    assert layer.keys.shape[-2] == 2 * CAPACITY_STEP and torch.equal(layer.keys[:, :, :5], keys)
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys[:, :, :5], keys[1:]) and layer.length == 5
    layer.set_length(3)
    assert layer.length == 3


def test_a_wide_tree_gives_the_eager_logits(compiled, eager):
    chain = TokenTree.from_choices(int(PROMPT[-1]), TreeTopology.chain(69),
                                   [40 + i % 5 for i in range(69)])
    results = []
    for model in (eager, compiled):
        verifier = TreeVerifier(model)
        verifier.prefill(PROMPT[:-1])
        results.append(verifier.verify(chain)[0])
    torch.testing.assert_close(results[1], results[0], **TOLERANCE)


def test_bad_settings_are_refused(compiled):
    with pytest.raises(ValueError, match="target.step is one of"):
        load_target(tiny="llama", step="fast")
    with pytest.raises(ValueError, match="packs its own weights"):
        load_target(tiny="llama", step="compiled", packed_rows=[4, 8])
    verifier = TreeVerifier(compiled)
    verifier.prefill(PROMPT)
    with pytest.raises(NotImplementedError, match="prefills a new sequence only"):
        verifier.prefill(PROMPT)


def test_the_profile_refuses_a_compiled_step_and_names_the_command_that_times_it(compiled):
    from experiments.profile import profile_sizes

    with pytest.raises(ValueError, match="experiments.step_limit"):
        profile_sizes(compiled, [1], context_len=4, repeats=1, seed=0)


def test_half_precision_runs_one_token_steps_through_the_tree_graph():
    # bfloat16: the one-token graph's rows round apart from the tree graph's; one graph for
    # both keeps a tree's rows the one-token step's (verify/runtime/compiled.py, min_width)
    step = load_target(tiny="llama", dtype="bfloat16", step="compiled").step
    plain = generate(step, PROMPT, 40).tokens
    drafter = PromptLookupDrafter(TreeTopology.from_choices([[0], [1], [0, 0]]), min_ngram=1)
    assert torch.equal(generate(step, PROMPT, 40, drafter=drafter).tokens, plain)
    assert {graph[0] for graph in step.compile_s} == {"trees"}


def test_one_graph_runs_float32_one_token_steps_through_the_tree_graph():
    # target.step=compiled_one_graph: plain and tree steps share the tree graph in float32 too
    step = load_target(tiny="llama", step="compiled_one_graph").step
    assert [step.width_for(rows, n) for rows, n in ((1, 1), (1, 3), (2, 1))] == [2, 3, 1]
    plain = generate(step, PROMPT, 40).tokens
    eager = generate(load_target(tiny="llama").step, PROMPT, 40).tokens
    assert torch.equal(plain, eager)
    drafter = PromptLookupDrafter(TreeTopology.from_choices([[0], [1], [0, 0]]), min_ngram=1)
    assert torch.equal(generate(step, PROMPT, 40, drafter=drafter).tokens, plain)
    assert {graph[0] for graph in step.compile_s} == {"trees"}
