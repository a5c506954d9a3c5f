"""Loading a target or draft from a folder: whole, causal, no folder code, no hub for a typo."""

import builtins
import json
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers.utils.hub
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BertConfig,
    BertForMaskedLM,
    BigBirdConfig,
    BlenderbotConfig,
    MBartConfig,
    MegatronBertConfig,
    PegasusConfig,
    PreTrainedTokenizerFast,
    RemBertConfig,
)

from drafters.draft_model import load_draft_model
from verify.runtime.files import UnreadableFileError
from verify.runtime.loading import looks_local
from verify.runtime.model import build_tiny_model, load_target


def save_tokenizer(folder: Path) -> None:
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    """A tiny Llama saved whole, with a tokenizer."""
    folder = tmp_path / "llama"
    build_tiny_model("llama").save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def test_a_whole_folder_loads_as_saved(llama_folder):
    target = load_target(str(llama_folder))
    saved = load_file(llama_folder / "model.safetensors")
    assert all(torch.equal(target.model.state_dict()[key], value) for key, value in saved.items())


def test_a_folder_missing_weights_or_holding_others_is_refused_naming_them(llama_folder):
    weights = llama_folder / "model.safetensors"
    tensors = load_file(weights)
    kept = {k: v for k, v in tensors.items() if ".layers.1." not in k and k != "lm_head.weight"}
    save_file(kept, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"target in .* does not hold its weights whole "
                                         r"\(missing: lm_head\.weight, model\.layers\.1\."):
        load_target(str(llama_folder))
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected: model\.extra\.weight"):
        load_target(str(llama_folder))


def test_an_encoder_folder_is_refused_as_not_causal(tmp_path):
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    save_tokenizer(tmp_path / "bert")
    with pytest.raises(ValueError, match="BertLMHeadModel, whose attention is not causal"):
        load_target(str(tmp_path / "bert"))


ENCODER = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64)
DECODER = dict(vocab_size=64, d_model=32, decoder_layers=1, decoder_attention_heads=2,
               decoder_ffn_dim=64, encoder_layers=1, encoder_attention_heads=2,
               encoder_ffn_dim=64, max_position_embeddings=64)
# Encoders whose ForCausalLM class loads without is_decoder: each token sees the whole sequence
BIDIRECTIONAL = {"bigbird": BigBirdConfig(**ENCODER),
                 "megatron-bert": MegatronBertConfig(**ENCODER),
                 "rembert": RemBertConfig(**ENCODER, input_embedding_size=16,
                                          output_embedding_size=16)}
# Decoders whose `encoder_attn` is cross-attention (no encoder states here): causal
CROSS_ATTENDING = {"bart": BartConfig(**DECODER), "mbart": MBartConfig(**DECODER),
                   "pegasus": PegasusConfig(**DECODER), "blenderbot": BlenderbotConfig(**DECODER)}


def saved_from_config(config, folder: Path) -> Path:
    """A random model of `config` (AutoModelForCausalLM's class for it) saved whole, with a
    tokenizer, at `folder`."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.mark.parametrize("arch", BIDIRECTIONAL)
def test_an_encoder_is_refused_by_what_it_computes(arch, tmp_path):
    folder = saved_from_config(BIDIRECTIONAL[arch], tmp_path / arch)
    with pytest.raises(ValueError, match=r"whose attention is not causal: changing token 5 "
                                         r"moved the logits before it"):
        load_target(str(folder), attn_implementation="eager")  # they have no sdpa


@pytest.mark.parametrize("arch", CROSS_ATTENDING)
def test_a_decoder_with_cross_attention_loads_as_the_causal_lm_it_is(arch, tmp_path):
    target = load_target(str(saved_from_config(CROSS_ATTENDING[arch], tmp_path / arch)))
    assert type(target.model).__name__.endswith("ForCausalLM")


EVIL = '''
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM

Path(MARKER).write_text("the folder's code ran")


class EvilConfig(LlamaConfig):
    model_type = "evil"


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
'''


def test_a_folders_own_code_runs_only_when_trusted(llama_folder, monkeypatch):
    # transformers runs a copy of the folder's code: it marks where the test looks
    (llama_folder / "evil.py").write_text(f"MARKER = {str(llama_folder / 'ran')!r}\n" + EVIL)
    config = json.loads((llama_folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (llama_folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(builtins, "input", lambda prompt="": "y")  # a user answering y
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_target(str(llama_folder))
    assert not (llama_folder / "ran").exists()
    # the setting, turned on knowingly
    assert type(load_target(str(llama_folder), trust_remote_code=True).model).__name__ == \
        "EvilForCausalLM"
    assert (llama_folder / "ran").exists()


@pytest.fixture
def hub_calls(monkeypatch) -> list:
    """Every hub download asked for (none is made): what a typo would have sent."""
    calls = []

    def record(*args, **kwargs):
        calls.append(args)
        raise huggingface_hub.errors.LocalEntryNotFoundError("no hub in tests")
    for module in (huggingface_hub, transformers.utils.hub):
        for name in ("hf_hub_download", "snapshot_download"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, record)
    return calls


@pytest.mark.parametrize("path", ["folders/goood", "./folders/good/x", "~/no-such-treedraft-x",
                                  "/no/such/folder", "a/b/c", "folders\\good"])
def test_a_missing_local_path_is_an_error_naming_it_before_any_hub_call(
        path, tmp_path, monkeypatch, hub_calls):
    (tmp_path / "folders" / "good").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"target {path!r}: no such folder".replace(
            "\\", "\\\\").replace(".", r"\.")):
        load_target(path)
    with pytest.raises(FileNotFoundError, match="draft model .*no such folder"):
        load_draft_model(path, load_target(tiny="llama"))  # drafter.path, hf_assistant_path
    assert hub_calls == []


def test_a_hub_id_still_goes_to_the_hub_as_the_environment_allows(tmp_path, monkeypatch,
                                                                     hub_calls):
    monkeypatch.chdir(tmp_path)
    assert not looks_local("someone/some-model") and not looks_local("gpt2")
    with pytest.raises(OSError):
        load_target("someone/some-model")
    assert hub_calls and hub_calls[0][0] == "someone/some-model"


def test_a_file_given_as_a_model_folder_is_refused(llama_folder):
    with pytest.raises(FileNotFoundError, match="is a file, not a model folder"):
        load_target(str(llama_folder / "config.json"))


def test_an_integer_dtype_is_refused():
    with pytest.raises(ValueError, match="target.dtype=int8 is not a floating-point dtype"):
        load_target(tiny="llama", dtype="int8")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_a_float8_dtype_is_refused_before_anything_loads(dtype, monkeypatch):
    # a storage format, not one a cast model's matmuls run in (torch: NotImplementedError)
    monkeypatch.setattr("verify.runtime.model.build_tiny_model",
                        lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ValueError, match=f"target.dtype={dtype} is not a floating-point dtype "
                                         "a model computes in: use float32, bfloat16 or float16"):
        load_target(tiny="llama", dtype=dtype)


@pytest.mark.parametrize("keep", [100, -40])  # a cut header, a cut body
def test_a_truncated_weights_file_is_named(llama_folder, keep):
    """safetensors' own error ("incomplete metadata") named no file."""
    weights = llama_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep])
    with pytest.raises(UnreadableFileError, match=rf"{re.escape(str(weights))} cannot be read "
                                                  r"\(truncated or corrupt\?\)"):
        load_target(str(llama_folder))


@pytest.mark.parametrize("left", [[], ["tokenizer_config.json"]])
def test_a_folder_without_its_tokenizer_files_is_named(llama_folder, left):
    """transformers said "need sentencepiece or tiktoken installed", naming neither the
    folder nor the files it lacks."""
    for file in llama_folder.iterdir():
        if "token" in file.name and file.name not in left:
            file.unlink()
    with pytest.raises(FileNotFoundError, match=rf"target in {re.escape(str(llama_folder))} "
                                                r"holds no tokenizer: none of tokenizer\.json, "
                                                r"tokenizer\.model"):
        load_target(str(llama_folder))
