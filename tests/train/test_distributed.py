"""`torchrun --nproc_per_node=2 train.py ...` on CPU (gloo): both ranks answer prompts and
train, rank 0 saves trained heads and evaluates them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


# Slow: tests/train/test_sharding.py runs two-rank ddp and fsdp jobs end to end in CI (rank 0
# saving and evaluating); this Medusa run adds the distilled data shared across ranks.
@pytest.mark.slow
def test_two_process_ddp_run_on_cpu(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_port=29517", "train.py", "experiment=smoke",
               f"out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
               "hydra.run.dir=" + str(tmp_path / "hydra")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = sorted((tmp_path / "cache").rglob("shard-*.safetensors"))
    assert len(shards) == 3  # 4 held-out prompts in one shard, 16 training prompts in two
    heads = load_file(str(tmp_path / "run/checkpoint/heads.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in heads.items() if "blocks" in k)  # trained
    results = json.loads((tmp_path / "run/eval.json").read_text())
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
    assert "greedy output identical" in done.stdout and done.stdout.count("| head |") == 1
