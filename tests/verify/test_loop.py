"""The generation loop: plain decoding, a noisy oracle drafter over a long generation (cache
compaction), EOS and length handling, and bad inputs."""

import time

import pytest
import torch

from verify.loop import generate
from verify.runtime.model import Target, hf_generate, load_target
from verify.sampling import SamplingParams
from verify.tree import TokenTree


@pytest.fixture(scope="module")
def model():
    return load_target(tiny="llama").model


def hf_greedy(model, prompt, n):
    out = model.generate(prompt[None], max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):]


class NoisyOracle:
    """Proposes a depth-3 tree whose first branch follows a known reference continuation for
    a while and then goes wrong, and whose second branch is wrong from the start."""

    feature_layers = ()  # reads no target hidden states
    target_top_k = 0

    def __init__(self, reference, prompt_len):
        self.reference, self.prompt_len = reference.tolist(), prompt_len
        self.step = 0

    def begin(self, prompt):
        self.step = 0

    def propose(self, ctx):
        done = len(ctx.tokens) - self.prompt_len
        good = self.reference[done:done + 3]
        keep = self.step % 4  # 0..3 correct tokens, then a wrong one
        wrong = [(t + 1) % 256 for t in good]
        path = good[:keep] + wrong[keep:keep + 1]
        self.step += 1
        return TokenTree.from_paths(int(ctx.tokens[-1]), [path, wrong[:1]] if path else [wrong[:1]])

    def update(self, tree, acceptance):
        pass


def test_plain_decoding_matches_hf_generate(model):
    prompt = torch.arange(5, 25)
    result = generate(model, prompt, 40)
    assert torch.equal(result.tokens, hf_greedy(model, prompt, 40))
    assert result.tau == 1.0 and len(result.steps) == 39


class SlowDrafter(NoisyOracle):
    """The oracle, with 5 ms of its own bookkeeping in `update`: loop time the loop reports
    as drafting (a drafter's update is its work), not as the loop's own."""

    def update(self, tree, acceptance):
        time.sleep(0.005)


def test_the_decode_time_is_drafting_verifying_and_the_loops_own(model):
    prompt = torch.arange(5, 25)
    reference = hf_greedy(model, prompt, 24)
    result = generate(model, prompt, 24, drafter=SlowDrafter(reference, len(prompt)))
    steps = len(result.steps)
    assert result.draft_s >= 0.005 * steps  # the updates' sleep is counted as drafting
    assert result.decode_s == pytest.approx(result.draft_s + result.verify_s + result.loop_s)
    assert 0 < result.loop_s < 0.005 * steps  # the loop's own time is what is left, and small
    plain = generate(model, prompt, 24)
    assert plain.decode_s > plain.verify_s and plain.loop_s > 0


def test_long_generation_with_compaction_stays_exact(model):
    prompt = torch.arange(5, 25)
    reference = hf_greedy(model, prompt, 300)
    result = generate(model, prompt, 300, drafter=NoisyOracle(reference, len(prompt)))
    assert torch.equal(result.tokens, reference)
    assert 1.5 < result.tau < 4.0  # the oracle is right 0-3 tokens at a time
    assert len(result.steps) < 200


def test_stops_at_eos_and_includes_it(model):
    prompt = torch.arange(5, 25)
    reference = generate(model, prompt, 30).tokens
    eos = int(reference[10])
    first = reference.tolist().index(eos)
    result = generate(model, prompt, 30, eos_token_id=eos,
                      drafter=NoisyOracle(reference, len(prompt)))
    assert result.tokens.tolist() == reference[: first + 1].tolist()


def test_an_eos_inside_an_accepted_path_ends_generation(model):
    prompt = torch.arange(5, 25)
    reference = generate(model, prompt, 30).tokens

    class Perfect(NoisyOracle):
        def propose(self, ctx):  # the next 3 reference tokens, all right
            done = len(ctx.tokens) - self.prompt_len
            return TokenTree.from_paths(int(ctx.tokens[-1]), [self.reference[done:done + 3]])

    # first step: tokens 1..4 (3 drafts + bonus); an EOS at index 2 sits inside its path
    eos = int(reference[2])
    assert eos not in reference[:2].tolist()
    result = generate(model, prompt, 30, eos_token_id=eos, drafter=Perfect(reference, 20))
    assert result.tokens.tolist() == reference[:3].tolist()
    assert len(result.steps) == 1


def test_stops_at_any_of_several_eos_ids_like_hugging_face(model):
    # Llama-3-Instruct and others list several EOS ids; generation ends at whichever comes first.
    prompt = torch.arange(5, 25)
    reference = generate(model, prompt, 30).tokens.tolist()
    first_new = [i for i in range(4, 30) if reference[i] not in reference[:i]]
    cut, far = first_new[0], first_new[-1]  # the EOS met first, and one met later if at all
    later, earlier = reference[far], reference[cut]
    model.generation_config.eos_token_id = [later, earlier]
    try:
        target = Target(model, None, "tiny-llama")
        assert target.eos_token_ids == (later, earlier) and target.eos_token_id == later
        expected = hf_generate(target, prompt, 30)
        result = generate(model, prompt, 30, eos_token_id=target.eos_token_ids,
                          drafter=NoisyOracle(torch.tensor(reference), len(prompt)))
    finally:
        model.generation_config.eos_token_id = None
    assert result.tokens.tolist() == reference[:cut + 1] == expected.tolist()


def test_sampling_is_reproducible_with_a_seed(model):
    prompt = torch.arange(5, 25)
    runs = [generate(model, prompt, 20, sampling=SamplingParams(1.0),
                     generator=torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("prompt, n, message", [
    (torch.tensor([], dtype=torch.long), 5, "prompt is empty"),
    (torch.arange(10), 0, "max_new_tokens must be positive"),
    (torch.arange(10), -3, "max_new_tokens must be positive"),
    (torch.zeros(510, dtype=torch.long), 5, "exceeds the model's context window"),
    (torch.zeros(600, dtype=torch.long), 1, "exceeds the model's context window"),
    (torch.tensor([5, 256, 7]), 5, r"token id 256 of the prompt is outside .* vocabulary of 256"),
    (torch.tensor([5, -1]), 5, "token id -1 of the prompt is outside"),
])
def test_bad_inputs_are_refused(model, prompt, n, message):
    with pytest.raises(ValueError, match=message):
        generate(model, prompt, n)


def test_negative_temperature_is_refused(model):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, torch.arange(5, 25), 5, sampling=SamplingParams(-0.5))


def test_drafter_with_a_wrong_root_is_refused(model):
    class WrongRoot(NoisyOracle):
        def propose(self, ctx):
            return TokenTree(torch.tensor([int(ctx.tokens[-1]) + 1]), torch.tensor([-1]))

    with pytest.raises(ValueError, match="rooted at"):
        generate(model, torch.arange(5, 25), 5, drafter=WrongRoot(torch.arange(5), 20))


def test_tree_is_dropped_near_the_end_of_the_context(model):
    prompt = torch.arange(500) % 200
    reference = generate(model, prompt, 12).tokens
    result = generate(model, prompt, 12, drafter=NoisyOracle(reference, len(prompt)))
    assert torch.equal(result.tokens, reference)
