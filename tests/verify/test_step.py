"""The target's step (verify/runtime/step.py): load_target chooses the kind and the Target carries
it; every kind answers the same interface with its own width rule and cache, and nothing is set on
the model for the verifier to find."""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, PreTrainedModel

from drafters.prompt_lookup import PromptLookupDrafter
from tests.verify import toy_step
from verify.loop import generate, generate_batch
from verify.runtime.cache import CAPACITY_STEP, RoomLayer, cache_length
from verify.runtime.compiled import CompiledStep
from verify.runtime.features import num_layers, resolve_layers, select_features
from verify.runtime.model import Target, build_tiny_model, load_target
from verify.runtime.packed import packing_unavailable
from verify.runtime.step import STEPS, EagerStep, PackedStep, as_step, target_step
from verify.tree import TokenTree, TreeBatch, TreeTopology
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


# -- the step table: every step kind answers the protocol the same way --------------------------
# A new step kind is one STEP_ROWS row (docs/extending.md); tests/verify/toy_step.py is the
# recipe followed.


@dataclass(frozen=True)
class StepRow:
    """name: the test id; settings: load_target's for a tiny Llama target; needs: why this
    machine cannot run the step, or None."""

    name: str
    settings: dict = field(default_factory=dict)
    needs: Callable[[], str | None] = lambda: None
    slow: bool = False  # a longer case: make test-all runs it

    @property
    def param(self):
        return pytest.param(self, id=self.name, marks=[pytest.mark.slow] if self.slow else [])


def _no_openvino() -> str | None:
    return None if importlib.util.find_spec("openvino") else "the openvino package is missing"


def _no_packing() -> str | None:
    return packing_unavailable(build_tiny_model("llama"))


STEP_ROWS = [
    StepRow("eager"),
    StepRow("packed", {"packed_rows": [2, 4, 8]}, needs=_no_packing),
    # its graphs take a minute to compile on a 2-core CPU; tests/verify/test_compiled.py checks
    # the same on every run
    StepRow("compiled", {"step": "compiled"}, slow=True),
    StepRow("openvino", {"step": "openvino"}, needs=_no_openvino),
    StepRow("toy", {"step": "toy"}),  # tests/verify/toy_step.py
]
STEP_PARAMS = [row.param for row in STEP_ROWS]
# float32 kernels of other libraries (compiled, OpenVINO) sum in other orders: ~1e-5 apart
STEP_TOLERANCE = 1e-4
LAYERS = (-1, 1)  # feature layers every state returns: the last and a middle one
# root, two children of the root, a grandchild under the second child, its child
STEP_TREE = TokenTree(torch.tensor([7, 11, 13, 17, 19]), torch.tensor([-1, 0, 0, 2, 3]))
NEXT_TREE = TokenTree(torch.tensor([23, 29, 31]), torch.tensor([-1, 0, 0]))
# the drafter table's prompts (tests/drafters/test_drafter_table.py): no greedy step of the tiny
# Llama target is a near tie on them, where kernels summing in other orders may pick apart
DECODE_PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])
DECODE_BATCH = [DECODE_PROMPT, DECODE_PROMPT[:9], DECODE_PROMPT[3:]]


@pytest.fixture(scope="module")
def step_of():
    """step_of(row) -> that row's step on a tiny Llama target, loaded once for the module (a
    compiled step's graphs compile once)."""
    loaded = {}

    def get(row: StepRow):
        if (reason := row.needs()) is not None:
            pytest.skip(reason)
        if row.name not in loaded:
            with pytest.MonkeyPatch.context() as patch:
                patch.setitem(STEPS, "toy", toy_step.build)  # the toy's one registry line
                loaded[row.name] = load_target(tiny="llama", **row.settings).step
        return loaded[row.name]
    return get


def plain_forward(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward over the whole of `tokens`, no cache, no tree: the last
    position's float logits (V,) and its LAYERS features (F * H,)."""
    with torch.no_grad():
        out = model(input_ids=tokens[None], output_hidden_states=True)
    return out.logits[0, -1].float(), select_features(out.hidden_states, LAYERS)[0, -1]


def path_tokens(tree: TokenTree, node: int) -> torch.Tensor:
    path = []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return torch.tensor(path[::-1])


def assert_tree_forward(model, context, tree, logits, features) -> None:
    """Each node's logits and features are the plain forward's over context + its path."""
    for node in range(len(tree)):
        want_logits, want_features = plain_forward(model, torch.cat([context,
                                                                     path_tokens(tree, node)]))
        assert (logits[node].cpu() - want_logits).abs().max() < STEP_TOLERANCE
        assert (features[node].float().cpu() - want_features).abs().max() < STEP_TOLERANCE


@pytest.mark.parametrize("row", STEP_PARAMS)
def test_a_step_answers_the_protocol(row, step_of):
    step = step_of(row)
    assert isinstance(step.model, PreTrainedModel) and isinstance(step.extends_prompts, bool)
    assert all(step.width_for(rows, n) >= n for rows in (1, 3) for n in (1, 2, 5))
    assert isinstance(step.has_graphs(1, False), bool)
    state = step.new_state(resolve_layers(LAYERS, num_layers(step.model.config)))
    assert all(callable(getattr(state, name)) for name in (
        "size", "prefill_rows", "extend", "run_trees", "keep_paths", "keep_rows"))
    assert state.size() == 0


@pytest.mark.parametrize("row", STEP_PARAMS)
def test_a_steps_trees_and_commits_give_the_plain_forwards_numbers(row, step_of):
    step = step_of(row)
    verifier = TreeVerifier(step, LAYERS)
    logits, features = verifier.prefill(PROMPT)
    assert (logits - plain_forward(step.model, PROMPT)[0]).abs().max() < STEP_TOLERANCE
    assert features.shape == (len(PROMPT), 2 * step.model.config.hidden_size)
    assert_tree_forward(step.model, PROMPT, STEP_TREE, *verifier.verify(STEP_TREE))
    verifier.commit([0, 2, 3])  # tokens 7, 13, 17 kept; nodes 1 and 4 dropped
    context = torch.cat([PROMPT, torch.tensor([7, 13, 17])])
    assert verifier.length == len(context) and verifier.cache_size >= len(context)
    assert_tree_forward(step.model, context, NEXT_TREE, *verifier.verify(NEXT_TREE))
    if step.extends_prompts:  # a prompt after cached tokens
        verifier.commit([0])
        context = torch.cat([context, torch.tensor([23])])
        more = torch.tensor([3, 4, 5])
        logits, features = verifier.prefill(more)
        assert (logits - plain_forward(step.model, torch.cat([context, more]))[0]
                ).abs().max() < STEP_TOLERANCE and features.shape[0] == len(more)


@pytest.mark.parametrize("row", STEP_PARAMS)
def test_a_batch_whose_rows_leave_keeps_each_rows_sequence(row, step_of):
    step = step_of(row)
    prompts = [PROMPT, torch.arange(40) % 50 + 3, PROMPT[:4]]
    verifier = TreeVerifier(step, LAYERS)
    verifier.prefill_batch(prompts)
    verifier.verify_batch(TreeBatch.pad([STEP_TREE, NEXT_TREE, STEP_TREE]))
    paths = [[0, 1], [0, 2], [0, 2, 3, 4]]
    verifier.commit_batch(paths)
    contexts = [torch.cat([prompt, tree.tokens[path]])
                for prompt, tree, path in zip(prompts, (STEP_TREE, NEXT_TREE, STEP_TREE), paths)]
    verifier.keep_rows(torch.tensor([2, 1]))  # the first row leaves; the others swap
    assert verifier.lengths.tolist() == [len(contexts[2]), len(contexts[1])]
    logits, features = verifier.verify_batch(TreeBatch.pad([NEXT_TREE, STEP_TREE]))
    for b, (context, tree) in enumerate(((contexts[2], NEXT_TREE), (contexts[1], STEP_TREE))):
        assert_tree_forward(step.model, context, tree, logits[b], features[b])


@pytest.mark.parametrize("row", STEP_PARAMS)
def test_greedy_decoding_on_a_step_equals_plain_eager_decoding(row, step_of):
    step = step_of(row)
    eager = EagerStep(step.model)
    plain = [generate(eager, prompt, 24).tokens for prompt in DECODE_BATCH]
    drafter = PromptLookupDrafter(TreeTopology.from_choices([[0], [1], [0, 0], [0, 0, 0]]),
                                  min_ngram=1)
    assert torch.equal(generate(step, DECODE_PROMPT, 24).tokens, plain[0])
    result = generate(step, DECODE_PROMPT, 24, drafter=drafter)
    assert torch.equal(result.tokens, plain[0]) and result.tau > 1  # trees were accepted
    batch = generate_batch(step, DECODE_BATCH, 24, drafter=drafter)
    for result, expected in zip(batch, plain):
        assert torch.equal(result.tokens, expected)
