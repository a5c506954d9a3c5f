"""A drafter's settings typed from its conf/drafter mapping, and the shallow copy of a model
config a self-draft or an EAGLE layer is built from."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from omegaconf import OmegaConf
from transformers import PretrainedConfig


def typed_config(schema: type, cfg: Mapping, what: str):
    """`cfg` (a conf/drafter mapping) merged into the dataclass `schema`, its only defaults:
    a misspelt key or a wrong type fails here, naming the known keys."""
    unknown = set(cfg) - set(schema.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {sorted(unknown)}; known: "
                         f"{sorted(schema.__dataclass_fields__)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(cfg)))


def shallow_config(config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """A copy of a model config with only its first `num_layers` decoder layers."""
    config = copy.deepcopy(config)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]  # Qwen2 checks the two agree
    config.num_hidden_layers = num_layers
    return config
