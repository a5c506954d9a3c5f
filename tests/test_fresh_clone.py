"""A fresh clone stands alone: copied with nothing beside it and no $TREEDRAFT_DATA, it reads
every shipped data file and runs a benchmark and a training run end to end on a tiny target.

The copy holds the files as git sees them (tracked and untracked-but-not-ignored), so what is
tested is what a commit of this working tree would ship; a file the code needs but git ignores
shows up here as a failure. Commands run with cwd = the copy, so the copy's packages are the
ones imported (the editable install's finder comes after the current folder on sys.path).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The tiny target's window is 512 positions and it encodes a prompt as its bytes: the first
# extraction, summarization and rag questions are longer, so the benchmark skips those three.
BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "stem", "humanities",
                    "translation", "qa", "math_reasoning"]

# Reads every shipped data file through the copy's own loaders; prints what it found as JSON.
READ_ALL = """
import json
import experiments.data as data
from train.prompts import load_prompt_files
questions = data.load_spec_bench()
files = load_prompt_files(None, ["gsm8k", "self_instruct", "t0"])
print(json.dumps({
    "module": data.__file__,
    "root": str(data.default_data_root()),
    "questions": len(questions),
    "categories": sorted({q.category for q in questions}),
    "prompt_rows": {name: len(texts) for name, texts in files.items()},
}))
"""


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The working tree's files, as git sees them, copied into an otherwise empty folder."""
    copy = tmp_path_factory.mktemp("fresh") / "treedraft"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not shipped
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    assert not (copy.parent / "shared").exists()
    return copy


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of a user who only has the clone: no data or import paths set."""
    environ = {k: v for k, v in os.environ.items() if k not in ("TREEDRAFT_DATA", "PYTHONPATH")}
    cache = tmp_path_factory.mktemp("cache")
    return {**environ, "TREEDRAFT_CACHE": str(cache), "WANDB_MODE": "disabled"}


def run_in(clone: Path, env: dict[str, str], *args: str) -> str:
    """Run `python *args` in the clone; returns stdout, failing the test on a non-zero exit."""
    done = subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_clone_reads_every_shipped_data_file_from_its_own_data_folder(clone, env):
    found = json.loads(run_in(clone, env, "-c", READ_ALL).splitlines()[-1])
    assert Path(found["module"]).is_relative_to(clone)
    assert Path(found["root"]) == clone / "data"
    assert found["questions"] == 480 and len(found["categories"]) == 13
    t0 = {f"t0/{path.stem}": 200 for path in (clone / "data" / "t0_prompts").glob("*.jsonl")}
    assert len(t0) == 6
    assert found["prompt_rows"] == {"gsm8k/train": 7473,
                                    "self_instruct/seed_tasks": 175,
                                    "self_instruct/user_oriented_instructions": 252, **t0}


def test_the_clone_runs_a_benchmark_on_spec_bench(clone, env, tmp_path):
    out = run_in(clone, env, "-m", "experiments.bench", "target=tiny_llama",
                 "drafter=prompt_lookup", "tree=chain4", f"num_prompts={len(BENCH_CATEGORIES)}",
                 f"categories=[{','.join(BENCH_CATEGORIES)}]", "max_new_tokens=8", "peers=[]",
                 "plot=false", f"out_dir={tmp_path / 'bench'}", f"hydra.run.dir={tmp_path}")
    report = tmp_path / "bench" / "tiny-llama-prompt_lookup-chain4.json"
    assert f"JSON: {report}" in out
    payload = json.loads(report.read_text())
    assert payload["config"]["data_root"] is None  # read from the default root: the clone's
    summary = payload["rows"][0]
    assert summary["prompts"] == len(BENCH_CATEGORIES)
    speeds = summary["methods"]["prompt_lookup/chain4"]["tokens_per_s"]
    assert set(speeds) == {*BENCH_CATEGORIES, "overall"}


def test_the_clone_trains_on_its_training_prompts(clone, env, tmp_path):
    run = tmp_path / "run"
    out = run_in(clone, env, "train.py", "experiment=smoke", f"out_dir={run}",
                 f"data.cache_dir={tmp_path / 'distill'}", f"hydra.run.dir={tmp_path}")
    assert f"checkpoint: {run / 'checkpoint'}" in out
    assert (run / "checkpoint" / "heads.safetensors").is_file()
    assert (run / "eval.json").is_file()
