"""One source per default.

Drafters: every conf/drafter YAML states each key of its drafter's config dataclass, at the
dataclass's default. A variant YAML (eagle3.yaml over EagleConfig) shares a dataclass with its
base YAML and differs from the defaults in exactly the fields listed for it in VARIANT_FIELDS,
so a default changed in one place and not the other fails here.

Optimisers: train.schema.OptimConfig holds the shared defaults; a conf/optim preset states only
what differs from them, and every preset composes to a complete optimiser config.
"""

from dataclasses import MISSING, asdict, fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import train.schema  # noqa: F401  (registers train_schema, which conf/train.yaml builds on)
from drafters.dflash import DFlashConfig
from drafters.draft_model import DraftModelConfig
from drafters.dspark import DSparkConfig
from drafters.eagle import EagleConfig
from drafters.hybrid import HybridConfig
from drafters.medusa import MedusaConfig
from drafters.pard import PardConfig
from drafters.prompt_lookup import PromptLookupConfig
from drafters.recycling import RecyclingConfig
from drafters.suffix import SuffixConfig
from experiments.common import CONF_DIR
from train.schema import OptimConfig

CONF = Path(CONF_DIR)
DRAFTER_SCHEMAS = {
    "dflash": DFlashConfig,
    "draft_model": DraftModelConfig,
    "dspark": DSparkConfig,
    "eagle": EagleConfig,
    "eagle3": EagleConfig,
    "hybrid": HybridConfig,
    "medusa": MedusaConfig,
    "pard": PardConfig,
    "prompt_lookup": PromptLookupConfig,
    "recycling": RecyclingConfig,
    "sam_hybrid": HybridConfig,
    "suffix": SuffixConfig,
}
# The fields a variant YAML exists to change; every other field stays at its dataclass default.
VARIANT_FIELDS = {
    "eagle3": {"name", "variant", "train_lm_head", "layout", "ttt_steps", "feature_weight",
               "ce_weight", "noise"},
    "sam_hybrid": {"members", "threshold"},
}
OPTIM_PRESETS = sorted(p.stem for p in (CONF / "optim").glob("*.yaml"))


def shipped(group: str) -> dict:
    """conf/<group>/*.yaml by name, each the file's own keys (a defaults list left out)."""
    configs = {}
    for path in sorted((CONF / group).glob("*.yaml")):
        own = OmegaConf.to_container(OmegaConf.load(path))
        own.pop("defaults", None)
        configs[path.stem] = own
    return configs


def plain(value):
    """YAML lists and dataclass tuples compare as lists."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def test_every_drafter_yaml_has_a_schema():
    assert set(shipped("drafter")) == set(DRAFTER_SCHEMAS)
    assert set(VARIANT_FIELDS) <= set(DRAFTER_SCHEMAS)


@pytest.mark.parametrize("name", sorted(DRAFTER_SCHEMAS))
def test_a_drafter_yaml_states_every_field_of_its_dataclass_and_no_other(name):
    schema = DRAFTER_SCHEMAS[name]
    assert set(shipped("drafter")[name]) == {f.name for f in fields(schema)}


@pytest.mark.parametrize("name", sorted(DRAFTER_SCHEMAS))
def test_a_drafter_yaml_agrees_with_its_dataclass_defaults_but_for_its_variant_fields(name):
    yaml, defaults = shipped("drafter")[name], asdict(DRAFTER_SCHEMAS[name]())
    differing = {key for key in defaults if plain(yaml[key]) != plain(defaults[key])}
    assert differing == VARIANT_FIELDS.get(name, set()), {
        key: (yaml[key], defaults[key]) for key in differing | VARIANT_FIELDS.get(name, set())}


@pytest.mark.parametrize("preset", OPTIM_PRESETS)
def test_an_optim_preset_states_only_what_differs_from_the_shared_defaults(preset):
    own = shipped("optim")[preset]
    schema = {f.name: f for f in fields(OptimConfig)}
    assert set(own) <= set(schema), set(own) - set(schema)
    defaults = {key: f.default for key, f in schema.items() if f.default is not MISSING}
    repeated = {key: value for key, value in own.items()
                if key in defaults and plain(value) == plain(defaults[key])}
    assert not repeated, f"conf/optim/{preset}.yaml repeats OptimConfig's defaults {repeated}"


@pytest.mark.parametrize("preset", OPTIM_PRESETS)
def test_every_optim_preset_composes_to_a_complete_config(preset):
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("train", [f"optim={preset}", "out_dir=/tmp/unused"])
    assert cfg.optim.name == preset
    assert OmegaConf.missing_keys(cfg.optim) == set()
