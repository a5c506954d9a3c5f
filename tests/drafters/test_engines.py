"""An exported EAGLE-3 draft, loaded by the `speculators` library itself (vLLM's source of
EAGLE-3 drafts), drafts what ours does: the same first-step logits on the same features.

speculators pins an older transformers than treedraft's, so it lives in .venv-engines
(scripts/engine_env.sh) and runs in a subprocess (tests/drafters/speculators_side.py). Without
that environment the test is skipped, unless TREEDRAFT_REQUIRE_ENGINES=1 (CI sets it), which
turns the skip into a failure.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from drafters.eagle import EagleDraft
from drafters.export import export_speculators_eagle3
from experiments.export import logit_gap
from tests.drafters.test_export import randomize

SIDE = Path(__file__).with_name("speculators_side.py")


def run_speculators(engine_python, folder, inputs, tmp_path):
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([str(engine_python), str(SIDE), str(folder), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "outputs.pt")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / "outputs.pt")


@pytest.mark.parametrize("vocab, norm_before_residual",
                         [(None, True), (torch.arange(5, 250, 2), False)])
def test_speculators_loads_our_export_and_drafts_the_same_logits(
        engine_python, tiny, tmp_path, vocab, norm_before_residual):
    target = tiny("llama")
    draft = randomize(EagleDraft(target.model, (0, 1, 2), vocab, train_lm_head=True,
                                 layout="eagle3"))
    draft.body.norm_before_residual = norm_before_residual
    # the library reads the verifier's folder named in the config (its layer count; weights
    # the folder lacks), so it has to exist, as the served target does
    target.model.save_pretrained(tmp_path / "verifier")
    folder = export_speculators_eagle3(draft, tmp_path / "spec", target,
                                       verifier=str(tmp_path / "verifier"))

    generator = torch.Generator().manual_seed(1)
    length, hidden = 12, target.model.config.hidden_size
    features = torch.randn(1, length, 3 * hidden, generator=generator)
    tokens = torch.randint(target.model.config.vocab_size, (1, length), generator=generator)
    positions = torch.arange(7, 7 + length)[None]  # not from 0: rotary offsets must agree
    with torch.no_grad():
        ours = draft.to_target_vocab(draft.logits(draft(draft.fuse_features(features), tokens,
                                                        positions)))[0]
    theirs = run_speculators(engine_python, folder, {
        "features": features, "tokens": tokens, "positions": positions}, tmp_path)

    assert theirs["feature_layers"] == [0, 1, 2]
    assert theirs["logits"].shape == ours.shape
    gap = logit_gap(ours, theirs["logits"])  # inf if they disagree on the draftable ids
    assert gap < 1e-4, f"speculators {theirs['speculators']} drafts differently: gap {gap}"
    assert torch.equal(ours.argmax(-1), theirs["logits"].argmax(-1))
