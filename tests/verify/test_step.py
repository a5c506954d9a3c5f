"""The target's step (verify/target/step.py): load_target chooses the kind and the Target carries
it; every kind answers the same interface with its own width rule and cache, and nothing is set on
the model for the verifier to find."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from verify.loop import generate
from verify.target.cache import CAPACITY_STEP, RoomLayer, cache_length
from verify.target.compiled import CompiledStep
from verify.target.model import Target, build_tiny_model, load_target
from verify.target.packed import packing_unavailable
from verify.target.step import EagerStep, PackedStep, as_step, target_step
from verify.tree import TokenTree, TreeBatch
from verify.verifier import TreeVerifier

INTERFACE = ("model", "extends_prompts", "width_for", "steps_cache", "make_room",
             "mask_columns", "has_graphs", "__call__")
PROMPT = torch.arange(3, 13)


def loaded(**settings) -> Target:
    if settings.get("packed_rows") and packing_unavailable(build_tiny_model("llama")):
        pytest.skip("packing needs a float32 CPU torch build with MKL")
    return load_target(tiny="llama", **settings)


@pytest.mark.parametrize("settings, kind", [
    ({}, EagerStep), ({"packed_rows": [2, 4, 8]}, PackedStep), ({"step": "compiled"}, CompiledStep),
    ({"dtype": "bfloat16", "step": "compiled"}, CompiledStep)])
def test_load_target_chooses_the_kind_and_sets_nothing_on_the_model(settings, kind):
    target = loaded(**settings)
    assert type(target.step) is kind and target.step.model is target.model
    assert all(hasattr(target.step, name) for name in INTERFACE)
    # the model's own attributes are a plain one's: the step rides on the Target, not on it
    assert set(vars(target.model)) == set(vars(load_target(tiny="llama").model))


def test_each_kind_has_its_width_rule():
    model = build_tiny_model("llama")
    eager = EagerStep(model)
    assert [eager.width_for(rows, n) for rows, n in ((1, 1), (1, 3), (4, 5))] == [1, 3, 5]
    packed = PackedStep(model, (4, 8, 16))  # the width rule alone: nothing packed
    assert [packed.width_for(1, n) for n in (1, 3, 4, 5, 9, 17)] == [1, 3, 4, 8, 16, 17]
    assert [packed.width_for(4, n) for n in (1, 3)] == [1, 4]  # B * N rows are packed
    compiled = CompiledStep(model)  # compiles nothing until it is called
    assert [compiled.width_for(rows, n) for rows, n in ((1, 1), (1, 3), (2, 1))] == [1, 3, 1]
    half = CompiledStep(build_tiny_model("llama").to(torch.bfloat16))
    assert [half.width_for(rows, n) for rows, n in ((1, 1), (1, 3), (2, 1))] == [2, 3, 1]


def test_eager_and_compiled_caches_differ_in_the_step_not_in_the_verifier():
    model = build_tiny_model("llama")
    eager, compiled = TreeVerifier(model), TreeVerifier(CompiledStep(model))
    for verifier in (eager, compiled):
        verifier.prefill(PROMPT)
    eager_cache, compiled_cache = eager.state.cache, compiled.state.cache
    assert eager.step.steps_cache(eager_cache) is eager_cache  # a growing cache, as prefilled
    assert eager.step.mask_columns(eager_cache) is None and eager.step.has_graphs(1, True)
    layer = compiled_cache.layers[0]  # room for the prompt and a step
    assert isinstance(layer, RoomLayer) and layer.max_cache_len == CAPACITY_STEP
    assert compiled.step.mask_columns(compiled_cache) == CAPACITY_STEP
    assert not compiled.step.has_graphs(1, False)  # nothing compiled yet
    compiled.step.make_room(compiled_cache, CAPACITY_STEP)  # 10 + 256 slots: grows
    assert compiled_cache.layers[0].max_cache_len == 2 * CAPACITY_STEP
    assert cache_length(compiled_cache) == len(PROMPT)
    batch = TreeBatch.pad([TokenTree(torch.tensor([5, 6]), torch.tensor([-1, 0]))])
    mask = eager.state.batch_inputs(batch, eager.lengths)[0]
    assert mask.shape[-1] == len(PROMPT) + 2  # S + N columns
    mask = compiled.state.batch_inputs(batch, compiled.lengths)[0]
    assert mask.shape[-1] == 2 * CAPACITY_STEP  # the whole room


def test_a_bare_model_gets_the_eager_step_and_a_step_is_kept():
    model = build_tiny_model("llama")
    step = as_step(model)
    assert type(step) is EagerStep and step.model is model and as_step(step) is step
    assert TreeVerifier(step).step is step and TreeVerifier(model).model is model
    target = Target(model, None, "tiny-llama")
    assert type(target.step) is EagerStep and target.step.model is model


def tiny_mistral(window: int | None):
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=window)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("step", ["eager", "compiled"])
def test_a_sliding_window_is_refused_at_load_not_at_the_first_cache_commit(step):
    with pytest.raises(ValueError, match=r"the target's layers \[0, 1\] cache "
                                         r"\['DynamicSlidingWindowLayer'\] \(a sliding window of "
                                         r"16 tokens\).*sliding_window: null"):
        target_step(tiny_mistral(16), step)
    # the same model without the window decodes
    no_window = tiny_mistral(None)
    assert len(generate(target_step(no_window, "eager"), PROMPT, 4).tokens) == 4
