"""Throughput of the scale-out pipeline on this machine: regeneration and feature extraction on
one rank against two, training on cached (offline) features against live (online) ones.

    python -m experiments.scale_speed                        # ~10 min on 2 CPU cores
    python -m experiments.scale_speed 'parts=[regenerate]' regenerate.conversations=48

Every figure comes from a subprocess of the real command (`torchrun` for two ranks) on small,
fixed sizes in a scratch folder, read back from what that command writes: the regeneration's
account.json, the feature cache's manifest.json, a training run's eval.json (its `training`
block). Two ranks on two cores run one thread each; one rank runs torch's default threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.common import CONF_DIR, check_report, report_name, write_report
from experiments.table import markdown_table
from verify.runtime.files import read_json

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("regenerate", "features", "training")


def command(ranks: int, module: str | None, script: str | None, port: int) -> list[str]:
    """`python [-m] <module|script>` for one rank, under torchrun for more."""
    entry = ["-m", module] if module else [script]
    if ranks == 1:
        return [sys.executable, *entry]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={port}", *entry]


def run(args: list[str], scratch: Path) -> None:
    """Run a command from the repository root; its output goes to a log in `scratch`, shown
    (its tail) when it fails."""
    log = scratch / f"log-{len(list(scratch.glob('log-*')))}.txt"
    with log.open("w") as out:
        done = subprocess.run(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "WANDB_MODE": "disabled"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{log.read_text()[-3000:]}")


def regeneration_row(cfg: DictConfig, ranks: int, scratch: Path) -> dict:
    """Regeneration tokens/s with `ranks` ranks (account.json's this_run)."""
    folder = scratch / f"regenerate-{ranks}"
    regen = cfg.regenerate
    run(command(ranks, "experiments.regenerate", None, cfg.port) + [
        f"target={cfg.target_option}", f"target.dtype={regen.dtype}",
        f"regen.conversations={regen.conversations}",
        f"regen.max_new_tokens={regen.max_new_tokens}", f"regen.batch_size={regen.batch_size}",
        f"regen.out_dir={folder}", f"hydra.run.dir={folder}/hydra"], scratch)
    account = read_json(folder / "account.json", "regeneration account")
    this_run = account["this_run"]
    return {"part": "regenerate", "setting": f"{regen.dtype}, batch {regen.batch_size}",
            "ranks": ranks, "tokens": this_run["tokens"], "seconds": this_run["seconds"],
            "tokens_per_s": this_run["tokens_per_s"], "account": account}


def training_run(cfg: DictConfig, drafter: str, ranks: int, online: bool, steps: int,
                 scratch: Path, strategy: str = "ddp") -> tuple[dict, dict | None]:
    """A short training run's eval.json and its feature manifest (None when online)."""
    name = f"{drafter}-{'online' if online else 'offline'}-{ranks}-{strategy}"
    out, cache = scratch / name, scratch / f"cache-{name}"
    train = cfg.training
    run(command(ranks, None, "train.py", cfg.port) + [
        f"drafter={drafter}", f"target={cfg.target_option}",
        f"target.dtype={cfg.target.dtype}", "logger=none",
        f"data.sharegpt_tokens={train.sharegpt_tokens}", "data.num_prompts=0",
        f"data.heldout_prompts={train.heldout_prompts}", "data.max_new_tokens=32",
        f"data.cache_hidden={str(not online).lower()}", f"data.cache_dir={cache}",
        f"optim.max_steps={steps}", f"optim.warmup_steps={min(steps, 10)}",
        f"save_every={steps}", "eval.num_prompts=1", "eval.max_new_tokens=8",
        f"dist.strategy={strategy}",
        f"out_dir={out}", f"hydra.run.dir={out}/hydra"], scratch)
    results = read_json(out / "eval.json", "training results")
    manifests = [read_json(p, "feature manifest")
                 for p in (cache / "features").rglob("manifest.json")]
    # the training sequences' cache: the larger of the two (the other holds the held-out ones)
    manifest = max(manifests, key=lambda m: m["tokens"]) if manifests and not online else None
    return results, manifest


def feature_row(drafter: str, ranks: int, manifest: dict) -> dict:
    extracted = manifest["extracted"]
    return {"part": "features", "setting": f"{drafter} layers {manifest['layers']}, "
            f"{manifest['bytes_per_token']:,} bytes a token", "ranks": ranks,
            "tokens": extracted["tokens"], "seconds": extracted["seconds"],
            "tokens_per_s": extracted["tokens_per_s"],
            "bytes_per_token": manifest["bytes_per_token"]}


def training_row(drafter: str, online: bool, results: dict, strategy: str = "ddp") -> dict:
    speed = results["training"]
    shared = f", {strategy}" if speed["ranks"] > 1 else ""
    return {"part": "training",
            "setting": f"{drafter}, {'online' if online else 'offline'}{shared}",
            "ranks": speed["ranks"], "tokens": None, "seconds": speed["seconds"],
            "tokens_per_s": speed["tokens_per_s"], "steps_per_s": speed["steps_per_s"]}


def evaluate(cfg: DictConfig, scratch: Path) -> list[dict]:
    rows = []
    unknown = set(cfg.parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {list(PARTS)}")
    if "regenerate" in cfg.parts:
        rows += [regeneration_row(cfg, ranks, scratch) for ranks in cfg.ranks]
    if "features" in cfg.parts or "training" in cfg.parts:
        for drafter in cfg.training.drafters:
            results, manifest = training_run(cfg, drafter, 1, False, cfg.training.steps, scratch)
            if "features" in cfg.parts:
                rows.append(feature_row(drafter, 1, manifest))
            if "training" in cfg.parts:
                online, _ = training_run(cfg, drafter, 1, True, cfg.training.steps, scratch)
                rows += [training_row(drafter, False, results),
                         training_row(drafter, True, online)]
    drafter = cfg.training.drafters[-1]
    for ranks in [r for r in cfg.ranks if r > 1]:
        if "features" in cfg.parts:
            _, manifest = training_run(cfg, drafter, ranks, False, 2, scratch)
            rows.append(feature_row(drafter, ranks, manifest))
        if "training" in cfg.parts:  # the frozen target sharded too: the 8B preset's setting
            results, _ = training_run(cfg, drafter, ranks, True, cfg.training.steps, scratch,
                                      strategy="fsdp")
            rows.append(training_row(drafter, True, results, "fsdp"))
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["part", "setting", "ranks", "tokens", "seconds", "tokens/s"]
    table = [[r["part"], r["setting"], r["ranks"], "" if r["tokens"] is None else
              f"{r['tokens']:,}", f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.1f}"]
             for r in rows]
    return markdown_table(header, table) + (
        "\n\nregenerate: tokens the target generated; features: tokens prefilled into the "
        "cache (wall time until every rank was done); training: padded (B, T) sequence tokens "
        "through the draft's steps, checkpoints included (online: the target's forward too).")


@hydra.main(config_path=CONF_DIR, config_name="scale_speed", version_base=None)
def main(cfg: DictConfig) -> None:
    # the subprocesses get the target by its conf/target option, as this command got it
    cfg.target_option = HydraConfig.get().runtime.choices["target"]
    stem = report_name(cfg, "scale-speed")
    check_report(cfg.out_dir, stem, cfg)
    with tempfile.TemporaryDirectory(prefix="scale-speed-") as scratch:
        rows = evaluate(cfg, Path(scratch))
    print(format_table(rows))
    path = write_report(Path(cfg.out_dir), stem, rows, cfg)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
