"""A trained drafter's folder names its kind (drafters.checkpoint.checkpoint_kind): a folder
given to a drafter of another kind is refused naming both, before its files are read as the
wrong kind's (a KeyError, transformers' "Unrecognized model")."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.checkpoint import checkpoint_kind
from drafters.dflash import DFlashDraft
from drafters.dflash import save_draft as save_dflash
from drafters.draft_model import load_draft_model, save_draft_model, truncated_copy
from drafters.eagle import EagleDraft
from drafters.eagle import save_draft as save_eagle
from drafters.medusa import MedusaHeads, save_heads
from drafters.pard import PardDraft, mean_embedding, write_mask
from verify.features import eagle3_layers, num_layers


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
        "dflash": "DFlash", "eagle": "EAGLE", "medusa": "Medusa", "draft_model": "draft model",
        "pard": "PARD", "hf": "Hugging Face model"}
    assert checkpoint_kind(tmp_path) is None and checkpoint_kind(tmp_path / "absent") is None


@pytest.mark.parametrize("drafter, key, kind, needs, use", [
    ("eagle", "checkpoint", "dflash", "the EAGLE drafter needs an EAGLE one", "drafter=dflash"),
    ("eagle3", "checkpoint", "dflash", "the EAGLE drafter needs an EAGLE one",
     "drafter=dflash"),
    ("medusa", "checkpoint", "eagle", "the Medusa drafter needs a Medusa one",
     "drafter=eagle or eagle3"),
    ("dflash", "checkpoint", "medusa", "the DFlash drafter needs a DFlash one",
     "drafter=medusa"),
    ("draft_model", "path", "dflash", "a draft model needs a draft model one",
     "drafter=dflash"),
    ("pard", "path", "eagle", "the PARD drafter needs a PARD one", "drafter=eagle or eagle3"),
    ("eagle", "checkpoint", "pard", "the EAGLE drafter needs an EAGLE one",
     "drafter=pard drafter.path=")])
def test_a_checkpoint_of_another_kind_is_refused_naming_both(
        folders, tiny, conf, drafter, key, kind, needs, use):
    kinds = {"dflash": "a DFlash", "eagle": "an EAGLE", "medusa": "a Medusa", "pard": "a PARD"}
    cfg = OmegaConf.merge(conf("drafter", drafter), {key: str(folders[kind])})
    tree = conf("tree", "chain3")
    with pytest.raises(ValueError, match=f"holds {kinds[kind]} checkpoint, but {needs}: "
                                         f"load it with {use}"):
        build_drafter(cfg, tree, tiny("llama"))


def test_pard_adapts_from_a_draft_model_or_a_models_folder_not_from_a_heads(folders, tiny):
    # train.py drafter=pard drafter.path=<folder> starts from load_draft_model's draft
    target = tiny("llama")
    for kind in ("draft_model", "pard", "hf"):
        model, _ = load_draft_model(folders[kind], target)
        assert isinstance(model, torch.nn.Module)
    with pytest.raises(ValueError, match="holds a DFlash checkpoint, but a draft model needs"):
        load_draft_model(folders["dflash"], target)
