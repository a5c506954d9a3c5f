"""Resuming (train.checkpoint.check_resumable) refuses a run folder whose checkpoint is another
drafter's, naming its kind, before reading it as the asked drafter's."""

import re

import pytest
from omegaconf import OmegaConf

from drafters.draft_model import save_draft_model, truncated_copy
from drafters.pard import PardDraft, mean_embedding, write_mask
from train.checkpoint import check_resumable
from verify.runtime.model import load_target


@pytest.mark.parametrize("drafter, kind", [("dflash", "a DFlash draft"), ("medusa", "Medusa heads"),
                                           ("eagle3", "an EAGLE-1 draft or an EAGLE-3 draft"),
                                           ("draft_model", "a distilled draft model")])
def test_resuming_a_pard_runs_folder_as_another_drafter_names_both_kinds(
        drafter, kind, tmp_path):
    target = load_target(tiny="llama")
    draft = truncated_copy(target.model, 1)
    pard = PardDraft(draft, 4, None, mean_embedding(draft))
    found = tmp_path / "checkpoint"
    save_draft_model(draft, None, found, target, {"num_layers": 1},
                     extra=lambda tmp: write_mask(tmp, pard))
    cfg = OmegaConf.create({"drafter": {"name": drafter}})
    with pytest.raises(ValueError, match=re.escape(
            f"{found} holds a PARD draft (python train.py drafter=pard), but drafter={drafter} "
            f"needs {kind}: use another out_dir, or resume=false to start over")):
        check_resumable(found, target, {}, cfg)
