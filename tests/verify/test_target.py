"""Target loading: tiny random models, prompt encoding, the default model's cache, configs."""

import importlib.util
import inspect
import math
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verify.runtime import model as target_mod
from verify.runtime.model import (
    DEFAULT_INSTALL,
    TINY_ARCHS,
    Target,
    cache_root,
    load_target,
    load_target_from_config,
)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "target"
PROMPT = "What is the capital of France?"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_target_loads(arch):
    target = load_target(tiny=arch)
    assert target.name == f"tiny-{arch}"
    assert target.tokenizer is None
    assert not target.model.training
    assert target.model.config.vocab_size == 256
    assert target.max_context == 512
    assert target.eos_token_id is None
    assert target.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_weights_depend_only_on_seed(arch):
    rng_before = torch.random.get_rng_state()
    first = load_target(tiny=arch, seed=3).model.state_dict()
    again = load_target(tiny=arch, seed=3).model.state_dict()
    other = load_target(tiny=arch, seed=4).model.state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    assert torch.equal(torch.random.get_rng_state(), rng_before)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_distributions_are_peaked(arch):
    target = load_target(tiny=arch)
    ids = target.encode_prompt(PROMPT)
    with torch.no_grad():
        probs = target.model(ids[None]).logits[0].softmax(-1)  # (T, V)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    assert entropy.mean() < 0.6 * math.log(256)
    assert probs.max(-1).values.mean() > 0.2


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_greedy_generation_is_not_degenerate(arch):
    target = load_target(tiny=arch)
    ids = target.encode_prompt(PROMPT)[None]
    out = target.model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    assert len(set(out.tolist())) >= 8


def test_tiny_dtype_and_eager_attention():
    target = load_target(tiny="llama", dtype="bfloat16", attn_implementation="eager")
    assert next(target.model.parameters()).dtype == torch.bfloat16
    assert target.model.config._attn_implementation == "eager"


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="tiny architecture"):
        load_target(tiny="mamba")
    with pytest.raises(ValueError, match="dtype"):
        load_target(tiny="llama", dtype="float33")


def test_encode_prompt_without_tokenizer_uses_bytes():
    target = load_target(tiny="gpt2")
    ids = target.encode_prompt("Hé")
    assert ids.dtype == torch.long
    assert ids.tolist() == list("Hé".encode("utf-8"))
    assert target.decode(ids) == "Hé"
    with pytest.raises(ValueError, match="zero tokens"):
        target.encode_prompt("")


def _word_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<eos>", "hello", "world", "user", "assistant", ":"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def test_encode_prompt_with_and_without_chat_template():
    tokenizer = _word_tokenizer()
    target = Target(load_target(tiny="llama").model, tokenizer, "words")
    assert target.encode_prompt("hello world").tolist() == [2, 3]
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    assert target.encode_prompt("hello world").tolist() == [4, 6, 2, 3, 1, 5, 6]


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "env"))
    assert cache_root(str(tmp_path / "arg")) == tmp_path / "arg"
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("TREEDRAFT_CACHE")
    assert cache_root() == Path.home() / ".cache" / "treedraft"


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == target_mod.DEFAULT_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError) as error:
        load_target(cache_dir=str(tmp_path))
    assert DEFAULT_INSTALL in str(error.value)


@pytest.mark.parametrize("path", sorted(CONF_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_target_configs_match_load_target(path):
    cfg = OmegaConf.load(path)
    parameters = set(inspect.signature(load_target).parameters)
    assert set(cfg) == parameters | {"name"}
    if cfg.tiny is not None:
        target = load_target_from_config(cfg)
        assert target.name == cfg.name


@pytest.mark.slow
def test_default_target_converts_once_then_loads_from_cache(tmp_path):
    start = time.perf_counter()
    load_target(cache_dir=str(tmp_path))
    first = time.perf_counter() - start
    start = time.perf_counter()
    target = load_target(cache_dir=str(tmp_path))
    cached = time.perf_counter() - start
    print(f"default target: first load {first:.1f} s, cached load {cached:.1f} s")
    assert cached < first / 3
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2-135m-instruct"]
    assert target.eos_token_id == 2 and target.max_context == 8192

    ids = target.encode_prompt(PROMPT)[None]
    out = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in target.decode(out[0, ids.shape[1] :])
