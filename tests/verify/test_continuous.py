"""Continuous batching (verify/runtime/continuous.py) on the OpenVINO step: every answer equals
decoding its prompt alone, a follow-up prompt reuses the cached prefix, captured features equal
a prefill's, and sampled answers follow the target's distribution (a wrong sampler fails)."""

import itertools

import pytest
import torch

from experiments.stats import chi_square_test
from verify.loop import generate
from verify.runtime.continuous import ContinuousBatcher
from verify.runtime.features import num_layers, resolve_layers, select_features
from verify.runtime.model import build_tiny_model, load_target
from verify.runtime.openvino_step import OpenVINOStep
from verify.sampling import SamplingParams

LAYERS = (1, -1)
FEATURE_TOLERANCE = 1e-4  # float32 kernels of another library, summed in another order


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return load_target(tiny=request.param, step="openvino")


def prompts(count, seed=0, longest=40):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (count,), generator=generator).tolist()
    return [torch.randint(0, 256, (n,), generator=generator) for n in lengths]


def answer_all(batcher, asked):
    """Submit every (key, prompt) and step until all are answered: {key: tokens}."""
    for key, prompt in asked:
        batcher.submit(key, prompt)
    answers = {}
    while batcher.busy():
        answers.update((key, tokens.tolist()) for key, tokens in batcher.step())
    return answers


def test_every_answer_equals_decoding_its_prompt_alone(target):
    asked = prompts(11)
    # 3 rows, 12 tokens a forward: long prompts are split in chunks beside decoding rows
    batcher = ContinuousBatcher(target.step.new_state(()), max_rows=3, max_new_tokens=15,
                                step_tokens=12)
    answers = answer_all(batcher, enumerate(asked))
    for key, prompt in enumerate(asked):
        assert answers[key] == generate(target.step, prompt, 15).tokens.tolist()


def test_an_answer_ends_at_a_stop_token(target):
    prompt = prompts(1, seed=3)[0]
    alone = generate(target.step, prompt, 12).tokens.tolist()
    stop = alone[4]
    batcher = ContinuousBatcher(target.step.new_state(()), max_rows=2, max_new_tokens=12,
                                stop=[stop])
    answer = answer_all(batcher, [("a", prompt)])["a"]
    assert answer == alone[:alone.index(stop) + 1]


def test_a_follow_up_prompt_reuses_the_cached_prefix(target):
    first = prompts(1, seed=1)[0]
    batcher = ContinuousBatcher(target.step.new_state(()), max_rows=2, max_new_tokens=8)
    answer = answer_all(batcher, [("c", first)])["c"]
    follow_up = torch.cat([first, torch.tensor(answer), torch.tensor([3, 1, 4, 1, 5])])
    before = batcher.fed
    again = answer_all(batcher, [("c", follow_up)])["c"]
    # fed: the last answer token (never fed), the 5 new tokens, then 7 decoding steps
    assert batcher.fed - before == 1 + 5 + 7
    assert again == generate(target.step, follow_up, 8).tokens.tolist()


def test_captured_features_equal_a_prefill(target):
    step = target.step
    layers = resolve_layers(LAYERS, num_layers(step.model.config))
    batcher = ContinuousBatcher(step.new_state(layers), max_rows=2, max_new_tokens=6,
                                step_tokens=8)
    asked = prompts(3, seed=2)
    answers = answer_all(batcher, enumerate(asked))
    # the sequences as training reads them: prompt, answer and a closing token, fed only
    sequences = {key: torch.cat([asked[key], torch.tensor(answers[key]), torch.tensor([9])])
                 for key in answers}
    done = answer_all_fed(batcher, sequences)
    assert done == {key: [] for key in sequences}
    fed = batcher.fed
    assert answer_all_fed(batcher, {0: sequences[0]}) == {0: []}  # all cached: nothing fed
    assert batcher.fed == fed
    for key, sequence in sequences.items():
        expected = eager_features(step.model, sequence, layers)
        captured = batcher.features(key)
        assert captured.shape == expected.shape
        assert (captured - expected).abs().max() < FEATURE_TOLERANCE * expected.abs().max()


@torch.no_grad()
def eager_features(model, sequence, layers):
    """(T, F * H) float32 features of Hugging Face's eager forward."""
    out = model.base_model(input_ids=sequence[None], output_hidden_states=True)
    return select_features(out.hidden_states, layers)[0]


def answer_all_fed(batcher, sequences):
    """Feed each sequence (a prompt-only request) and step until all are fed."""
    for key, sequence in sequences.items():
        batcher.submit(key, sequence, max_new_tokens=0)
    done = {}
    while batcher.busy():
        done.update((key, tokens.tolist()) for key, tokens in batcher.step())
    return done


def test_released_rows_are_reused():
    target = load_target(tiny="llama", step="openvino")
    batcher = ContinuousBatcher(target.step.new_state(()), max_rows=2, max_new_tokens=3)
    for round_ in range(3):
        answer_all(batcher, [(f"{round_}-{i}", p) for i, p in enumerate(prompts(2, round_))])
        for i in range(2):
            batcher.release(f"{round_}-{i}")
    assert len(batcher.state.tables) == 2  # two rows made, then reused


def test_bad_requests_are_refused():
    target = load_target(tiny="llama", step="openvino")
    with pytest.raises(ValueError, match="step_tokens"):
        ContinuousBatcher(target.step.new_state(()), max_rows=8, max_new_tokens=3,
                          step_tokens=8)
    batcher = ContinuousBatcher(target.step.new_state(()), max_rows=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="empty prompt"):
        batcher.submit("a", torch.empty(0, dtype=torch.long))
    batcher.submit("a", torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="already waiting"):
        batcher.submit("a", torch.tensor([1, 2]))


VOCAB = 6


def two_token_distribution(model, prompt, params):
    """{(t1, t2): probability} of the first two sampled tokens, enumerated with the eager model."""
    def probs(ids):
        logits = model(input_ids=ids[None]).logits[0, -1]
        return torch.softmax(logits.float() / params.temperature, -1)
    with torch.no_grad():
        first = probs(prompt)
        return {(a, b): float(first[a] * probs(torch.cat([prompt, torch.tensor([a])]))[b])
                for a, b in itertools.product(range(VOCAB), repeat=2)}


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "wrong-row control"])
def test_sampled_answers_follow_the_target_distribution(wrong, monkeypatch):
    model = build_tiny_model("llama", vocab_size=VOCAB)
    step, params = OpenVINOStep(model), SamplingParams(1.0)
    prompt = torch.tensor([1, 4, 2])
    if wrong:  # the control: each row samples from the next row's logits
        real = ContinuousBatcher._advance
        monkeypatch.setattr(ContinuousBatcher, "_advance", lambda self, keys, logits: real(
            self, keys, None if logits is None else logits.roll(1, 0)))
    batcher = ContinuousBatcher(step.new_state(()), max_rows=40, max_new_tokens=2,
                                sampling=params, step_tokens=160)
    draws = 4000
    for key in range(draws):
        prompt_k = prompt if key % 2 == 0 else torch.tensor([3, 3, 0, 5])  # rows differ
        batcher.submit(key, prompt_k, torch.Generator().manual_seed(key))
    answers = {}
    while batcher.busy():
        answers.update((key, tuple(tokens.tolist())) for key, tokens in batcher.step())
    sampled = [answers[key] for key in range(0, draws, 2)]
    counts = {pair: sampled.count(pair) for pair in set(sampled)}
    p_value = chi_square_test(counts, two_token_distribution(model, prompt, params))[1]
    assert (p_value < 1e-4) if wrong else (p_value > 1e-3)


def test_an_answer_does_not_depend_on_its_batch():
    model = build_tiny_model("qwen2", vocab_size=VOCAB)
    step, params = OpenVINOStep(model), SamplingParams(1.0)
    prompt = torch.tensor([2, 2, 5])

    def answer(others):
        batcher = ContinuousBatcher(step.new_state(()), max_rows=4, max_new_tokens=6,
                                    sampling=params)
        for key in range(others):
            batcher.submit(key, torch.tensor([key % VOCAB, 1]), torch.Generator().manual_seed(key))
        batcher.submit("me", prompt, torch.Generator().manual_seed(123))
        answers = {}
        while batcher.busy():
            answers.update(batcher.step())
        return answers["me"].tolist()
    assert answer(0) == answer(3) == answer(9)
