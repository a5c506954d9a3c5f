"""What a folder holds (drafters.checkpoint.checkpoint_kind), read from its files alone (no
weights, no target): a folder given to a drafter of another kind is refused naming both,
before its files are read as the wrong kind's (a KeyError, transformers' "Unrecognized
model")."""

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.checkpoint import FOLDER_KINDS, checkpoint_kind, describe
from drafters.dflash import DFlashDraft
from drafters.dflash import save_draft as save_dflash
from drafters.draft_model import load_draft_model, save_draft_model, truncated_copy
from drafters.eagle import EagleDraft
from drafters.eagle import save_draft as save_eagle
from drafters.medusa import MedusaHeads, save_heads
from drafters.pard import PardDraft, mean_embedding, write_mask
from verify.runtime.features import eagle3_layers, num_layers
from verify.runtime.files import UnreadableFileError


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny) -> dict[str, Path]:
    """One folder of each kind, trained on nothing, for the tiny Llama."""
    root, target = tmp_path_factory.mktemp("kinds"), tiny("llama")
    model = target.model
    layers = eagle3_layers(num_layers(model.config))
    save_dflash(DFlashDraft(model, layers, block_size=4, layers=1), root / "dflash", target)
    save_eagle(EagleDraft(model, (num_layers(model.config),)), root / "eagle", target)
    save_heads(MedusaHeads(model.get_output_embeddings(), 2, 1), root / "medusa", target)
    draft = truncated_copy(model, 1)
    save_draft_model(draft, None, root / "draft_model", target, {"num_layers": 1})
    pard = PardDraft(draft, 4, None, mean_embedding(draft))
    save_draft_model(draft, None, root / "pard", target, {"num_layers": 1},
                     extra=lambda tmp: write_mask(tmp, pard))
    model.save_pretrained(root / "hf")
    return {name: root / name for name in ("dflash", "eagle", "medusa", "draft_model", "pard",
                                           "hf")}


def test_each_folder_names_its_kind(folders, tmp_path):
    assert {name: checkpoint_kind(folder) for name, folder in folders.items()} == {
        "dflash": "dflash", "eagle": "eagle1", "medusa": "medusa", "draft_model": "draft_model",
        "pard": "pard", "hf": "hf_model"}
    assert checkpoint_kind(tmp_path) == checkpoint_kind(tmp_path / "absent") == "unknown"


@pytest.mark.parametrize("drafter, key, kind, needs, use", [
    ("eagle", "checkpoint", "dflash", "the EAGLE drafter needs an EAGLE-1 draft or an EAGLE-3 "
     "draft", "drafter=dflash"),
    ("eagle3", "checkpoint", "dflash", "the EAGLE drafter needs an EAGLE-1 draft or an EAGLE-3 "
     "draft", "drafter=dflash"),
    ("medusa", "checkpoint", "eagle", "the Medusa drafter needs Medusa heads", "drafter=eagle"),
    ("dflash", "checkpoint", "medusa", "the DFlash drafter needs a DFlash draft",
     "drafter=medusa"),
    ("draft_model", "path", "dflash", "a draft model needs a distilled draft model, a PARD "
     "draft or a Hugging Face model folder", "drafter=dflash"),
    ("pard", "path", "eagle", "the PARD drafter needs a PARD draft, a distilled draft model or "
     "a Hugging Face model folder", "drafter=eagle"),
    ("eagle", "checkpoint", "pard", "the EAGLE drafter needs an EAGLE-1 draft or an EAGLE-3 "
     "draft", "drafter=pard drafter.path=")])
def test_a_checkpoint_of_another_kind_is_refused_naming_both(
        folders, tiny, conf, drafter, key, kind, needs, use):
    found = describe(checkpoint_kind(folders[kind]))
    cfg = OmegaConf.merge(conf("drafter", drafter), {key: str(folders[kind])})
    tree = conf("tree", "chain3")
    with pytest.raises(ValueError, match=re.escape(f"holds {found}, but {needs}: load it with "
                                                   f"{use}")):
        build_drafter(cfg, tree, tiny("llama"))


def test_pard_adapts_from_a_draft_model_or_a_models_folder_not_from_a_heads(folders, tiny):
    # train.py drafter=pard drafter.path=<folder> starts from load_draft_model's draft
    target = tiny("llama")
    for kind in ("draft_model", "pard", "hf"):
        model, _ = load_draft_model(folders[kind], target)
        assert isinstance(model, torch.nn.Module)
    with pytest.raises(ValueError, match=r"holds a DFlash draft \(.*\), but a draft model needs"):
        load_draft_model(folders["dflash"], target)


@pytest.mark.parametrize("config, kind", [
    ({"drafter": "dflash", "feature_layers": [1, 2, 3], "target": {}}, "dflash"),
    ({"feature_layers": [1, 2, 3], "target": {}}, "eagle3"),
    ({"feature_layers": [1], "layout": "eagle3", "target": {}}, "eagle3"),
    ({"feature_layers": [1], "target": {}}, "eagle1"),  # older ones name no layout
    ({"num_heads": 3, "num_layers": 1, "target": {}}, "medusa"),
    ({"model_type": "llama", "vocab_size": 256}, "hf_model"),
    ({"model_type": "medusa", "num_heads": 3}, "vllm_medusa"),
    ({"speculators_model_type": "dflash"}, "speculators"),
    ({"speculators_model_type": "dspark", "drafter": "dspark"}, "speculators"),  # the export first
    ({"something": "else"}, "unknown"),
])
def test_a_folder_s_kind_comes_from_its_config(tmp_path, config, kind):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_kind(tmp_path) == kind
    assert kind in FOLDER_KINDS


def test_a_run_folder_an_empty_one_and_a_broken_config(tmp_path):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "config.json").write_text('{"num_heads": 2, "target": {}}')
    assert checkpoint_kind(tmp_path / "run") == "run"
    assert checkpoint_kind(tmp_path) == "unknown"
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(UnreadableFileError, match="config.json"):
        checkpoint_kind(tmp_path)
