"""What a target is, not what it is called: the identity caches, checkpoints and exports carry.

A name is not an identity: `target.seed=1` or a model folder replaced at the same path keeps
the name and changes every weight. A fingerprint holds the name, a digest of the model config,
the dtype, the merged LoRA adapter and a digest of the weights.

The weights' digest hashes a fixed sample of every tensor: its name, shape, and 1,024 values
spread evenly over it (strided), rounded to bfloat16. Why a sample and not the files' bytes:
targets need not come from files (tiny random models, a GGUF de-quantized in memory, an
adapter merged at load), and a sample costs milliseconds however large the model (hashing the
135M default's 540 MB would cost ~0.5 s per load, and a cache of file hashes would need its
own invalidation). Training, a new seed or another checkpoint moves every sampled value; an
edit confined to unsampled elements would go unseen, which no training run produces. Rounding
to bfloat16 makes a float32 target and its bfloat16 copy share one weights' digest, so a draft
trained on one decodes with the other (the dtype is still its own field, and keys caches).
"""

from __future__ import annotations

import hashlib
import json

import torch
from transformers import PretrainedConfig, PreTrainedModel

SAMPLES_PER_TENSOR = 1024
# What a drafter must match to load on a target: the dtype may differ (a draft trained on
# float32 decodes in bfloat16), and a Medusa-2 adapter is checked by the drafter itself, so
# the weights compared are those before any adapter was merged in.
IDENTITY_KEYS = ("name", "config", "base_weights")
# Config entries that say how a model runs, not what it computes.
_RUNTIME_CONFIG_KEYS = ("_attn_implementation", "attn_implementation", "dtype", "torch_dtype",
                        "transformers_version", "_name_or_path", "use_cache")


def weights_digest(model: torch.nn.Module) -> str:
    """16 hex digits over a strided sample of every tensor in `model`'s state dict."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // SAMPLES_PER_TENSOR)][:SAMPLES_PER_TENSOR]
        sample = sample.to("cpu", torch.bfloat16) if sample.is_floating_point() else sample.cpu()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def config_digest(config: PretrainedConfig) -> str:
    """16 hex digits over the model config, runtime settings (attention kernel, dtype) left out."""
    entries = {k: v for k, v in config.to_dict().items() if k not in _RUNTIME_CONFIG_KEYS}
    text = json.dumps(entries, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_fingerprint(model: PreTrainedModel, name: str, adapter: str | None = None,
                      base_weights: str | None = None) -> dict:
    """{name, config, dtype, adapter, weights, base_weights}: `base_weights` is the weights'
    digest before `adapter` was merged in (the weights' own when there is none)."""
    weights = weights_digest(model)
    return {"name": name, "config": config_digest(model.config),
            "dtype": str(model.dtype).removeprefix("torch."), "adapter": adapter,
            "weights": weights, "base_weights": base_weights or weights}


def identity(fingerprint: dict) -> dict:
    """The part of a fingerprint a trained drafter must match (IDENTITY_KEYS)."""
    return {key: fingerprint.get(key) for key in IDENTITY_KEYS}


def describe_difference(saved: dict, have: dict) -> str:
    """"config abc.. != def.., base_weights ..." over the keys where two fingerprints differ."""
    return ", ".join(f"{key} {saved.get(key)} != {have.get(key)}"
                     for key in sorted(set(saved) | set(have)) if saved.get(key) != have.get(key))


def describe_settings(saved: dict, asked: dict, skip: tuple[str, ...] = ()) -> str:
    """"key: saved a, asked b; ..." over the dotted keys (`skip` aside) where two nested
    records (run configs, what made a folder) differ; "" when they match."""
    before, now = flat_keys(saved, skip), flat_keys(asked, skip)
    return "; ".join(f"{key}: saved {before.get(key)!r}, asked {now.get(key)!r}"
                     for key in sorted(before.keys() | now.keys())
                     if before.get(key) != now.get(key))


def flat_keys(config: dict, skip: tuple[str, ...] = (), prefix: str = "") -> dict:
    """A nested record (a run config, what made a folder) flattened to dotted keys, the dotted
    keys in `skip` left out: what two records are compared over, key by key."""
    flat = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if dotted in skip:
            continue
        if isinstance(value, dict):
            flat.update(flat_keys(value, skip, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat
