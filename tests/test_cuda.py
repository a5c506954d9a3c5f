"""The CUDA path on tiny random targets: decoding through the tree verifier, each drafter kind,
sampling, training and the compiled step, all on the GPU (`pytest -m cuda`; part of
scripts/gpu_check.sh). Skipped without a GPU; TREEDRAFT_CUDA_TEST_DEVICE=cpu runs them on the
CPU (the script's dry run), where they check the same claims."""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import train.recipes.common
from drafters import build_drafter
from experiments.common import CONF_DIR
from train import run_training
from verify.loop import generate, generate_batch
from verify.runtime.model import hf_generate, load_target
from verify.sampling import SamplingParams
from verify.tree import TokenTree
from verify.verifier import TreeVerifier

pytestmark = pytest.mark.cuda

# As the drafter table's (tests/drafters/test_drafter_table.py): repetitive, so prompt lookup
# finds matches, and no greedy step of tiny-llama is a near tie there (top-2 logits > 1e-3
# apart), so that tree and plain forwards, and two devices, cannot round to different tokens.
PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])
BATCH = [PROMPT, PROMPT[:9], PROMPT[3:], torch.cat([PROMPT, torch.tensor([42, 44])])]
TREE = TokenTree(torch.tensor([41, 42, 43, 44, 40, 42]), torch.tensor([-1, 0, 0, 1, 2, 3]))
NEW_TOKENS = 40

# (conf/drafter, conf/tree, overrides for a 2-layer target): a draft model, a model-free
# drafter, and EAGLE-1 / EAGLE-3 with fresh (random) drafts on EAGLE-2 dynamic trees
DRAFTERS = [("draft_model", "tree16", {"num_layers": 1}), ("prompt_lookup", "tree8", {}),
            ("eagle", "eagle2", {}), ("eagle3", "eagle2", {})]


def conf(group: str, name: str):
    return OmegaConf.load(f"{CONF_DIR}/{group}/{name}.yaml")


@pytest.fixture(scope="module")
def target(cuda_device):
    return load_target(tiny="llama", device=str(cuda_device))


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy decoding of PROMPT on the GPU: every drafter must give exactly this."""
    return generate(target.model, PROMPT, NEW_TOKENS).tokens


def drafter_for(target, name: str, tree: str, overrides: dict):
    return build_drafter(OmegaConf.merge(conf("drafter", name), overrides), conf("tree", tree),
                         target)


def test_the_target_and_its_outputs_are_on_the_device(target, cuda_device):
    assert target.model.device.type == cuda_device.type
    verifier = TreeVerifier(target.model, feature_layers=(-1,))
    logits, features = verifier.prefill_batch([PROMPT])
    assert logits.device.type == cuda_device.type and features[0].device.type == cuda_device.type


def test_plain_decoding_on_the_device_equals_the_cpu(plain):
    on_cpu = generate(load_target(tiny="llama").model, PROMPT, NEW_TOKENS).tokens
    assert torch.equal(plain.cpu(), on_cpu)


def test_hugging_face_greedy_generate_on_the_device_equals_plain_decoding(target, plain):
    # the reference of experiments.correctness and the baseline of experiments.bench
    assert torch.equal(hf_generate(target, PROMPT, NEW_TOKENS), plain)


@pytest.mark.parametrize("name, tree, overrides", DRAFTERS, ids=[d[0] for d in DRAFTERS])
def test_greedy_tree_decoding_equals_plain_decoding(target, plain, name, tree, overrides):
    result = generate(target.model, PROMPT, NEW_TOKENS,
                      drafter=drafter_for(target, name, tree, overrides))
    assert torch.equal(result.tokens, plain)
    assert max(step.tree_size for step in result.steps) > 1, "the drafter never drafted"
    assert all(step.draft_s >= 0 and step.verify_s > 0 for step in result.steps)


@pytest.mark.parametrize("name, tree, overrides", DRAFTERS, ids=[d[0] for d in DRAFTERS])
def test_a_batch_decodes_each_row_as_alone(target, name, tree, overrides):
    expected = [generate(target.model, prompt, NEW_TOKENS).tokens for prompt in BATCH]
    results = generate_batch(target.model, BATCH, NEW_TOKENS,
                             drafter=drafter_for(target, name, tree, overrides))
    for result, want in zip(results, expected):
        assert torch.equal(result.tokens, want)


@pytest.mark.parametrize("name, tree, overrides", [
    ("prompt_lookup", "tree8", {}), ("eagle", "eagle2", {}),
    ("draft_model", "chain4", {"num_layers": 1})])  # a static tree's children sampled on the GPU
def test_sampling_runs_with_a_generator_on_the_device(target, cuda_device, name, tree,
                                                      overrides):
    # acceptance and sampled drafts draw from logits where the models left them: the generator
    # goes with them (as experiments.bench makes it); equal seeds give equal samples
    drafter = drafter_for(target, name, tree, overrides)  # one: a fresh one has other weights

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator(cuda_device).manual_seed(seed)
        return generate(target.model, PROMPT, NEW_TOKENS,
                        sampling=SamplingParams(1.0, top_p=0.9), drafter=drafter,
                        generator=generator).tokens

    tokens = sample(0)
    assert len(tokens) == NEW_TOKENS
    assert 0 <= int(tokens.min()) and int(tokens.max()) < target.model.config.vocab_size
    assert torch.equal(sample(0), tokens)


def test_a_compiled_step_gives_the_eager_steps_logits_and_tokens(target, cuda_device, plain):
    compiled = load_target(tiny="llama", device=str(cuda_device), step="compiled")
    outputs = []
    for step in (target.step, compiled.step):
        verifier = TreeVerifier(step, feature_layers=(-1,))
        verifier.prefill(PROMPT)
        outputs.append(verifier.verify(TREE))
    (eager_logits, eager_features), (compiled_logits, compiled_features) = outputs
    # float32: compiled kernels fuse and reorder the eager ones' sums; equal to rounding
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled_features, eager_features, atol=1e-4, rtol=1e-4)
    assert torch.equal(generate(compiled.step, PROMPT, NEW_TOKENS).tokens, plain)
    result = generate(compiled.step, PROMPT, NEW_TOKENS,
                      drafter=drafter_for(compiled, "eagle", "eagle2", {}))
    assert torch.equal(result.tokens, plain)
    assert compiled.step.compile_s, "nothing ran through the compiled step"


@pytest.mark.parametrize("drafter", ["eagle", "eagle3"])
def test_a_few_training_steps_on_the_device_end_with_a_finite_loss(tmp_path, monkeypatch,
                                                                   cuda_device, drafter):
    # eagle_smoke on the device, bfloat16 autocast on (where the GPU has it: train.loop)
    losses = []
    real_train_steps = train.recipes.common.train_steps

    def recording_train_steps(*args, **kwargs):
        metrics = real_train_steps(*args, **kwargs)
        losses.append(metrics["loss"])
        return metrics

    monkeypatch.setattr(train.recipes.common, "train_steps", recording_train_steps)
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("train", ["experiment=eagle_smoke", f"drafter={drafter}",
                                f"device={cuda_device.type}", "optim.autocast_bf16=true",
                                f"out_dir={tmp_path / 'run'}",
                                f"data.cache_dir={tmp_path / 'cache'}"])
    results = run_training(cfg)
    assert len(losses) == 1 and math.isfinite(losses[0])
    # the end-of-run evaluation decoded on the device with the saved draft, exactly
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
