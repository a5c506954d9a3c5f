"""experiments.speculators_trainer on a tiny target: the speculators library trains a few steps
from our step-0 draft on the batches our loop trains on, and its draft loads and decodes here;
without the library's environment the report says "not run". The training tests need
.venv-engines (skipped without it, failed where TREEDRAFT_REQUIRE_ENGINES=1)."""

import hashlib
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments  # noqa: F401  (registers speculators_trainer_schema)
from drafters import build_drafter
from drafters.eagle import load_speculators_eagle3
from experiments import speculators_trainer
from experiments.common import CONF_DIR
from train.distributed import DistEnv
from train.features import sequence_batcher
from train.recipes import eagle as eagle_recipe
from verify.loop import generate
from verify.runtime.files import read_json

CPU = DistEnv(0, 1, torch.device("cpu"))


def trainer_cfg(tmp_path: Path, *overrides: str, cache: Path | None = None,
                theirs: Path | str | None = None):
    """The smoke EAGLE-3 run on the tiny Llama (two layers: its hidden states 0, 1, 2 are
    three distinct auxiliary layers), writing under tmp_path, its caches in `cache` (default
    tmp_path / "cache")."""
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("speculators_trainer", [
            "experiment=eagle_smoke", "drafter.feature_layers=[0,1,2]",
            f"out_dir={tmp_path / 'ours'}", f"data.cache_dir={cache or tmp_path / 'cache'}",
            f"speculators.out_dir={theirs or tmp_path / 'theirs'}", *overrides])


@pytest.fixture(scope="module")
def trained(engine_python, tmp_path_factory):
    """The command run once (4 steps of 4 sequences): its config and report row."""
    tmp_path = tmp_path_factory.mktemp("speculators_trainer")
    # a relative folder, as users name it: the runner works in a scratch folder of its own
    cfg = trainer_cfg(tmp_path, theirs="theirs")
    with pytest.MonkeyPatch.context() as patch:  # the runner's threads: one, as pytest's
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.chdir(tmp_path)
        row = speculators_trainer.run(cfg)
    cfg.speculators.out_dir = str(tmp_path / "theirs")
    return cfg, row


def test_their_draft_trains_and_decodes_here(trained):
    cfg, row = trained
    assert row["status"] == "trained" and row["steps"] == cfg.optim.max_steps == 4
    assert all(torch.isfinite(torch.tensor(row["losses"])))
    # the library's recipe: its LM head (and the target's embedding) frozen
    assert "lm_head.weight" not in row["trained_parameters"]
    assert "fc.weight" in row["trained_parameters"]
    report = read_json(Path(cfg.speculators.out_dir) / "speculators_trainer.json", "report")
    assert report["rows"] == [row]
    start = eagle_recipe.setup(cfg, CPU)
    # trained: not the step-0 draft any more
    theirs = load_speculators_eagle3(row["draft"], start.target)
    assert not torch.equal(theirs.fuse.weight, start.draft.fuse.weight)
    # our bench's drafter loads their folder and decodes exactly
    drafter_cfg = {**OmegaConf.to_container(cfg.drafter), "checkpoint": row["draft"]}
    tree = OmegaConf.load(Path(CONF_DIR) / "tree" / "chain4.yaml")
    drafter = build_drafter(drafter_cfg, tree, start.target)
    prompt = start.heldout[0].input_ids[:12]
    plain = generate(start.target.model, prompt, 12)
    drafted = generate(start.target.model, prompt, 12, drafter=drafter)
    assert torch.equal(drafted.tokens, plain.tokens)
    assert f"drafter.checkpoint={row['ours']}" in row["bench_command"]
    assert f"checkpoint={row['draft']},label=speculators" in row["bench_command"]
    assert row["ours_command"].startswith("python train.py drafter=eagle3")


def test_both_trainers_start_from_the_same_draft(trained):
    cfg, _ = trained
    start = eagle_recipe.setup(cfg, CPU)  # what `python train.py drafter=eagle3` starts from
    step0 = load_speculators_eagle3(Path(cfg.speculators.out_dir) / "work" / "step0",
                                    start.target)
    ours = start.draft.state_dict()
    assert all(torch.equal(value, ours[name]) for name, value in step0.state_dict().items())


def our_batches(cfg) -> list[dict]:
    """What our loop's make_batch (train.features.sequence_batcher) trains on at each step, in
    the runner's terms: per step the sequences' lengths less one and the sha1 of their token
    ids less the first, one after another (the library's shift_batch, then its packing)."""
    start = eagle_recipe.setup(cfg, CPU)
    taken = []
    real_take = start.train_set.take
    start.train_set.take = lambda indices: taken.append(real_take(indices)) or taken[-1]
    make_batch = sequence_batcher(start.train_set, cfg, CPU)
    batches = []
    for step in range(cfg.optim.max_steps):
        make_batch(step)
        ids = torch.cat([s.input_ids[1:] for s in taken[-1]]).to(torch.int64).contiguous()
        batches.append({"lengths": [len(s.input_ids) - 1 for s in taken[-1]],
                        "sha1": hashlib.sha1(ids.numpy().tobytes()).hexdigest()})
    return batches


def test_the_runner_trains_on_the_batches_our_loop_trains_on(trained):
    cfg, row = trained
    assert row["batches"] == our_batches(cfg)
    # control: another seed orders the data otherwise
    other = trainer_cfg(Path(cfg.out_dir).parent, "seed=1")
    assert row["batches"] != our_batches(other)


@pytest.mark.slow  # a second training run (8 s), with the library's dense eager attention
def test_their_dense_attention_trains_alike(trained, tmp_path):
    """speculators.attention=eager, the library's dense-mask reference, beside the default
    sdpa: the same losses at every step (float32 here), so the default changes no objective."""
    cfg, row = trained
    assert cfg.speculators.attention == "sdpa"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        eager = speculators_trainer.run(trainer_cfg(tmp_path, "speculators.attention=eager",
                                                    cache=cfg.data.cache_dir))
    assert eager["losses"] == pytest.approx(row["losses"], rel=1e-5)


@pytest.mark.parametrize("venv, reason", [
    ("no-such-venv", r"not run: no-such-venv not installed \(.*no-such-venv/bin/python missing"),
    # treedraft's own environment: a Python without the library
    (".venv", r"not run: the speculators library is not installed in \.venv"),
])
def test_without_the_library_the_row_says_not_run(tmp_path, venv, reason, capsys):
    row = speculators_trainer.run(trainer_cfg(tmp_path, f"speculators.venv={venv}"))
    assert row["trainer"] == "speculators" and re.match(reason, row["status"]), row
    assert row["status"] in capsys.readouterr().out
    report = read_json(tmp_path / "theirs" / "speculators_trainer.json", "report")
    assert report["rows"] == [row]
    assert not (tmp_path / "cache").exists()  # said before any work


def test_the_report_renders_on_a_results_page(trained):
    from experiments.results import kind_of
    cfg, _ = trained
    path = Path(cfg.speculators.out_dir) / "speculators_trainer.json"
    report = read_json(path, "report")
    table = kind_of(report, path).render(report)
    assert "| speculators | trained | 4 |" in table and "speculators 0.9.0" in table
    not_run = {**report, "rows": [{"trainer": "speculators", "status": "not run: no env"}]}
    assert "| speculators | not run: no env | - |" in kind_of(not_run, path).render(not_run)
