"""scripts/gpu_check.sh: its dry run executes every step on the CPU at the smallest sizes and
writes every result the GPU run writes; without a GPU the real run refuses to start."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["cuda-tests", "regenerate", "train-eagle3", "train-eagle3-tiny", "train-eagle",
         *(f"correctness-{drafter}-{dtype}" for dtype in ("float32", "bfloat16")
           for drafter in ("prompt_lookup", "eagle", "eagle3")),
         "bench"]
ROWS = ["prompt_lookup-tree8", "eagle-eagle2", "eagle3-eagle2"]


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable}
    environment.pop("TREEDRAFT_CUDA_TEST_DEVICE", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=environment)


# 82-100 s here (12 processes, each paying its imports): the fast suite's longest test by far,
# for a script that only a session lent a GPU runs. So it runs with `make test-all`, and a
# session with a GPU runs it (or the script's own --dry-run) before the device call.
@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_every_result(tmp_path):
    out = tmp_path / "check"
    done = run_script("--dry-run", str(out))
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["device"] == "cpu"
    assert [step["step"] for step in summary["steps"]] == STEPS
    assert all(step["exit_status"] == 0 for step in summary["steps"])
    # the cuda tests ran on the CPU, none skipped
    suite = ElementTree.parse(out / "pytest-cuda.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) > 10
    assert [int(suite.get(key)) for key in ("failures", "errors", "skipped")] == [0, 0, 0]
    assert {"conversations.jsonl", "manifest.json"} <= {p.name for p in (out / "regen").iterdir()}
    for run in ("eagle3", "eagle3-tiny", "eagle"):
        assert (out / "train" / run / "eval.json").is_file()
    for dtype in ("float32", "bfloat16"):
        for row in ROWS:
            rows = json.loads((out / "correctness" / dtype / f"{row}.json").read_text())["rows"]
            assert [r["rule"] for r in rows] == ["greedy"]
    assert len(summary["correctness"]) == 6
    assert summary["float32_failures"] == []
    assert len(list((out / "bench").glob("*.json"))) == 1


def test_an_unknown_option_is_refused_with_the_usage():
    done = run_script("--fast", timeout=60)
    assert done.returncode == 2 and "usage: bash scripts/gpu_check.sh" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_real_run_refuses_to_start(tmp_path):
    done = run_script(str(tmp_path / "check"), timeout=120)
    assert done.returncode == 1 and "--dry-run" in done.stderr
    assert not (tmp_path / "check").exists()
