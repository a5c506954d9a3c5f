"""The `speculators` library's EAGLE-3 trainer beside ours, on the same data, steps, batches
and learning rate (issue 52, "the trainer, side by side").

    python -m experiments.speculators_trainer [the overrides of `python train.py drafter=eagle3`]
    python -m experiments.speculators_trainer optim.max_steps=400 seed=0   # e.g.

It composes the training config exactly as `python train.py drafter=eagle3` does with the
same overrides (conf/speculators_trainer.yaml includes conf/train.yaml; its own settings are
under `speculators.`), then:

1. builds what our EAGLE recipe starts from through the recipe's own code
   (train.recipes.eagle.setup): the target, the cached features of cfg.data (the same
   cache: nothing recomputed when our run made it first, and ours reads what this one made)
   and the step-0 draft, initialised as ours is (same seed, same draws before it). That draft
   is exported to the library's layout (drafters.export), so both trainers start from the
   same weights: initialisation is no variable of the comparison;
2. writes every training sequence as the library's sample (train.speculators_data) and, per
   step, the sequences train.loop.batch_indices gives our loop (same seed, same batch size)
   and the learning rate our warmup-cosine gives it;
3. trains in .venv-engines with the library's model, data packing, loss and optimizer builder
   (experiments/peer_runners/speculators_trainer_runner.py, whose docstring says which of its
   defaults it keeps and which it aligns with ours, and why its own `Trainer` cannot run on a
   CPU), showing its progress bar; the draft is saved with the library's save_pretrained;
4. loads the saved folder with our loader (drafters.eagle.load_speculators_eagle3; an error
   names the folder if it does not) and moves it to <speculators.out_dir>/draft, then prints
   the command that trains our side and the bench command that decodes Spec-Bench prompts
   with both drafts (acceptance by depth side by side);
5. writes <speculators.out_dir>/speculators_trainer.json: the settings (the resolved config),
   the loop's seconds and its losses, where both drafts are, the commands.

When .venv-engines or the library in it is missing, or the runner fails, the report's row
says "not run: <reason>" and the command ends normally.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from drafters.checkpoint import RUN_CHECKPOINT
from drafters.eagle import eagle_config, load_speculators_eagle3
from drafters.export import export_speculators_eagle3
from experiments.common import CONF_DIR, check_report, write_report
from experiments.engines import model_folder, run_runner, venv_python
from experiments.table import markdown_table
from train.distributed import DistEnv, init_distributed
from train.features import FeatureSet, LiveFeatures
from train.loop import batch_indices, chunks, warmup_cosine
from train.recipes import eagle as eagle_recipe
from train.schema import check_settings
from train.speculators_data import LOSS_MASKS, sample_of
from verify.runtime.files import read_json, save_atomically, write_atomically
from verify.runtime.model import Target

REPORT = "speculators_trainer"  # <speculators.out_dir>/<REPORT>.json
RUNNER = "speculators_trainer"  # experiments/peer_runners/<RUNNER>_runner.py
DRAFT = "draft"  # <speculators.out_dir>/<DRAFT>: their trained draft, speculators layout
BENCH_TREE = "chain4"  # acceptance at depths 1-4 of one chain: each depth one draft token
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the verifier is a local folder


def run(cfg: DictConfig) -> dict:
    """Train speculators' draft as cfg says (see the module docstring); the report's row."""
    side = cfg.speculators
    check_settings(cfg)
    check_drafter(cfg)
    out = Path(side.out_dir).absolute()  # the runner works in a scratch folder of its own
    check_report(out, REPORT, cfg)
    missing = engines_missing(side.venv)
    if missing is not None:
        return finish(cfg, {"trainer": "speculators", "status": f"not run: {missing}"})
    env = one_process(cfg.device)
    start = eagle_recipe.setup(cfg, env)
    work = out / "work"
    request = prepare(cfg, start, work, env)
    outcome = run_runner(RUNNER, venv_python(side.venv), request, side.timeout_s, work,
                         "trainer", env=OFFLINE, timeout_name="speculators.timeout_s",
                         echo=echo)
    if isinstance(outcome, str):
        return finish(cfg, {"trainer": "speculators", "status": f"not run: {outcome}"})
    result = read_json(outcome, "speculators trainer result")
    draft = place_draft(Path(request["out"]), out / DRAFT, start.target)
    return finish(cfg, trained_row(cfg, result, draft))


def check_drafter(cfg: DictConfig) -> None:
    """Only an EAGLE-3 draft in EAGLE-3's layout reading both inputs has the library's layout:
    refused before anything loads otherwise."""
    layout = inputs = None
    if cfg.drafter.name in ("eagle", "eagle3"):
        ecfg = eagle_config(cfg.drafter)
        layout, inputs = ecfg.layout, ecfg.inputs
    if (layout, inputs) != ("eagle3", "both"):
        raise ValueError(f"the speculators library trains EAGLE-3 drafts in its own layout, "
                         f"which drafter={cfg.drafter.name} (layout {layout}, inputs {inputs}) "
                         "is not: use drafter=eagle3's layout and inputs")
    if cfg.speculators.loss_mask not in LOSS_MASKS:
        raise ValueError(f"speculators.loss_mask must be one of {LOSS_MASKS}, got "
                         f"{cfg.speculators.loss_mask!r}")


def one_process(device: str) -> DistEnv:
    """This process alone on `device` (train.py's device=): the runner trains each step's
    whole batch, so a torchrun job's ranks would each train the whole draft."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("experiments.speculators_trainer runs as one process: start it "
                         "without torchrun")
    return init_distributed(device)


def engines_missing(venv: str) -> str | None:
    """Why the library cannot run: its environment or the library missing; None when both are
    there (found without importing it: seconds, not the library's start-up)."""
    python = venv_python(venv)
    if not python.is_file():
        return f"{venv} not installed ({python} missing: scripts/engine_env.sh)"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('speculators') is None)"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=120)
    if found.returncode != 0:
        return f"the speculators library is not installed in {venv} (scripts/engine_env.sh)"
    return None


def prepare(cfg: DictConfig, start: eagle_recipe.Setup, work: Path, env: DistEnv) -> dict:
    """The runner's request, with the files it reads written under `work`: the step-0 draft
    exported, the samples, the verifier's folder (the library reads its config and heads)."""
    work.mkdir(parents=True, exist_ok=True)
    side, optim = cfg.speculators, cfg.optim
    export = export_speculators_eagle3(start.draft, work / "step0", start.target,
                                       speculative_tokens=start.config.ttt_steps,
                                       verifier=model_folder(start.target, work))
    samples = work / "samples.pt"
    payload = training_samples(start.train_set, start.draft.feature_layers, start.target,
                               side.loss_mask)
    save_atomically(samples, lambda tmp: torch.save(payload, tmp))
    return {"draft": str(export), "samples": str(samples), "out": str(work / "trained"),
            "batches": step_batches(len(start.train_set), cfg, env),
            "lrs": learning_rates(cfg), "ttt_steps": start.config.ttt_steps,
            "step_decay": start.config.step_decay, "loss_fn": side.loss_fn,
            "loss_implementation": side.loss_implementation, "attention": side.attention,
            "betas": list(optim.betas), "weight_decay": optim.weight_decay,
            "grad_clip": optim.grad_clip, "autocast_bf16": optim.autocast_bf16,
            "train_lm_head": side.train_lm_head, "device": cfg.device, "seed": cfg.seed}


def training_samples(train_set: FeatureSet | LiveFeatures, aux_layers: Sequence[int],
                     target: Target, loss_mask: str) -> list[dict]:
    """Every training sequence, in our order (index i is our sequence i), as the library's
    sample; features float16, as cached (a live set computes them here, a chunk at a time)."""
    hidden = target.model.config.hidden_size
    stored = train_set.layers
    return [sample_of(s, stored, aux_layers, hidden, loss_mask)
            for part in chunks(range(len(train_set)), 64) for s in train_set.take(list(part))]


def step_batches(num_items: int, cfg: DictConfig, env: DistEnv) -> list[list[int]]:
    """Per step, the sequences our loop trains on (train.features.sequence_batcher's)."""
    return [batch_indices(step, num_items, cfg.optim.batch_sequences, cfg.seed, env).tolist()
            for step in range(cfg.optim.max_steps)]


def learning_rates(cfg: DictConfig) -> list[float]:
    """Per step, the learning rate our loop trains at: train.loop.warmup_cosine of optim.lr."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    factor = warmup_cosine(optimizer, cfg.optim.warmup_steps, cfg.optim.max_steps).lr_lambdas[0]
    return [cfg.optim.lr * factor(step) for step in range(cfg.optim.max_steps)]


def echo(text: str) -> None:
    """The runner's output (its progress bar) as it comes."""
    sys.stderr.write(text)
    sys.stderr.flush()


def place_draft(saved: Path, dest: Path, target: Target) -> Path:
    """The folder the library saved, checked to load as our draft, moved to `dest` (replacing
    an earlier one at once); ValueError naming the folder when it does not load."""
    try:
        load_speculators_eagle3(saved, target)
    except (ValueError, OSError) as error:
        raise ValueError(f"the draft speculators saved in {saved} does not load as treedraft's "
                         f"EAGLE-3 draft: {error}") from error

    def move(tmp: Path) -> None:
        for path in saved.iterdir():
            path.rename(tmp / path.name)

    write_atomically(dest, move, overwrite=True)
    saved.rmdir()
    return dest


def trained_row(cfg: DictConfig, result: dict, draft: Path) -> dict:
    """The report's row of a finished run: its figures, both drafts, the commands."""
    losses, seconds = result["losses"], result["seconds"]
    ours = Path(cfg.out_dir) / RUN_CHECKPOINT
    return {"trainer": "speculators", "status": "trained", "steps": len(losses),
            "seconds": round(seconds, 2), "seconds_per_step": round(seconds / len(losses), 4),
            "first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
            "batches": result["batches"],  # per step: its documents' lengths, its tokens' sha1
            "device": result["device"], "trained_parameters": result["trained"],
            "versions": result["versions"], "draft": str(draft), "ours": str(ours),
            "ours_command": our_command(cfg), "bench_command": bench_command(cfg, ours, draft)}


def task_overrides() -> list[str]:
    """This command's train overrides, as given (its own `speculators.` ones left out)."""
    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.task
            if not o.lstrip("+~").startswith(("speculators.", "out_dir=", "drafter="))]


def our_command(cfg: DictConfig) -> str:
    """`python train.py drafter=eagle3` with the same overrides, writing to cfg.out_dir (named
    so, since this command's own overrides are in the name Hydra gave it)."""
    return shlex.join(["python", "train.py", "drafter=eagle3", *task_overrides(),
                       f"out_dir={cfg.out_dir}"])


def bench_command(cfg: DictConfig, ours: Path, theirs: Path) -> str:
    """experiments.bench decoding Spec-Bench prompts with both drafts on one chain: ours under
    drafter=, theirs as a compare entry labelled "speculators"."""
    target = HydraConfig.get().runtime.choices.get("target") if HydraConfig.initialized() \
        else None
    compare = f'compare=["eagle3:{BENCH_TREE}:checkpoint={theirs},label=speculators"]'
    return shlex.join(["python", "-m", "experiments.bench",
                       *([f"target={target}"] if target else []), "drafter=eagle3",
                       f"drafter.checkpoint={ours}", f"tree={BENCH_TREE}", compare,
                       "peers=[plain_loop]", "out_dir=results/bench/speculators-trainer"])


def finish(cfg: DictConfig, row: dict) -> dict:
    """The row written as the report and said."""
    path = write_report(Path(cfg.speculators.out_dir), REPORT, [row], cfg)
    print(summary(row))
    print(f"\nJSON: {path}")
    return row


def format_table(rows: list[dict]) -> str:
    """A saved report as a table (the results pages): each run's status, steps, speed, loss and
    what it trained, with the library's version."""
    lines = []
    for row in rows:
        if row["status"] != "trained":
            lines.append([row["trainer"], row["status"], "-", "-", "-", "-", "-"])
            continue
        versions = ", ".join(f"{k} {v}" for k, v in sorted(row["versions"].items()))
        lines.append([row["trainer"], row["status"], str(row["steps"]),
                      f"{row['seconds_per_step']:.2f}",
                      f"{row['first_loss']:.3f} -> {row['final_loss']:.3f}",
                      str(len(row["trained_parameters"])), versions])
    return markdown_table(["trainer", "status", "steps", "s/step", "loss (KL), first -> last",
                           "trained tensors", "versions"], lines)


def summary(row: dict) -> str:
    if row["status"] != "trained":
        return f"speculators trainer: {row['status']}"
    return "\n".join([
        f"speculators trainer: {row['steps']} steps in {row['seconds']:.1f} s "
        f"({row['seconds_per_step']:.3f} s/step, {row['device']}), loss "
        f"{row['first_loss']:.3f} -> {row['final_loss']:.3f}",
        f"their draft: {row['draft']}",
        f"our side (same data, steps, batches, lr): {row['ours_command']}",
        f"both on Spec-Bench: {row['bench_command']}"])


@hydra.main(config_path=CONF_DIR, config_name="speculators_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
