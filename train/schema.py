"""Typed schemas of the training config, registered in Hydra's ConfigStore.

conf/train.yaml names `train_schema` first in its defaults, so every YAML group and every
command-line override is merged into these dataclasses and type-checked: `optim.lr=fast` or a
misspelt key fails at composition, not an hour into a run. The `drafter` and `tree` groups hold
different keys per option, so they stay open here; each recipe checks its own drafter keys
(drafters.medusa.MedusaConfig, drafters.eagle.EagleConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TargetConfig:
    """conf/target: what verify.target.load_target takes, plus a name for result tables."""

    name: str = MISSING
    path: str | None = None
    gguf_file: str | None = None
    cache_dir: str | None = None
    tiny: str | None = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    seed: int = 0
    adapter: str | None = None  # a peft LoRA folder merged into the model (Medusa-2 targets)
    device: str | None = None   # where it loads; training then moves it to train.py's device=
    # "auto", a list of row counts or null (verify/packed.py); training loads the target unpacked
    packed_rows: Any = None
    # "eager" or "compiled" (verify/compiled.py): the decoding step that self-distillation runs;
    # a target that trains (Medusa-2's adapter) always loads eager
    step: str = "eager"


@dataclass
class DataConfig:
    """conf/data: self-distillation data, the target's own answers to training prompts."""

    name: str = MISSING
    root: str | None = None  # holds gsm8k/, self_instruct/, t0_prompts/;
    #                          null: $TREEDRAFT_DATA, else the repo's data/
    sources: list[str] = field(default_factory=lambda: ["gsm8k", "self_instruct", "t0"])
    num_prompts: int = 1024  # training prompts answered by the target
    heldout_prompts: int = 32  # answered too, never trained on: the end-of-run evaluation
    max_prompt_tokens: int = 384  # longer prompts are skipped (long articles dominate the cost)
    max_new_tokens: int = 128  # Spec-Bench's generation length
    batch_size: int = 64  # prompts answered per batched `generate` call
    cache_dir: str | None = None  # null: <treedraft cache>/distill
    cache_hidden: bool = True  # Medusa-1 trains on the cached states; false: recomputes them
    sharegpt_tokens: int = 0  # EAGLE: ShareGPT tokens prefilled for features (0: none)
    max_sequence_tokens: int = 512  # EAGLE: a conversation is cut to this many tokens
    seed: int = 0


@dataclass
class OptimConfig:
    """conf/optim: AdamW with linear warm-up and cosine decay.

    These defaults are the only ones: each value is the one most conf/optim presets share, and
    each preset states only what differs from them (tests/test_defaults.py checks it repeats
    none). How long a recipe trains is its own, so every preset names max_steps."""

    name: str = MISSING
    lr: float = 1e-3  # the drafter's learning rate (Medusa's heads, the EAGLE layer, the draft)
    base_lr: float = 1e-4  # the target's LoRA adapter (Medusa-2); heads learn faster
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    max_steps: int = MISSING
    batch_tokens: int = 4096  # hidden-state rows per step (Medusa-1; the others batch sequences)
    batch_sequences: int = 8  # conversations (up to data.max_sequence_tokens) per step: the rest
    grad_clip: float = 1.0
    # A batch whose loss or gradient is not finite stops training; up to this many are
    # skipped instead (counted, each named), for data known to hold a few bad rows.
    max_nonfinite_skips: int = 0
    autocast_bf16: bool = True  # bf16 matmuls on CPUs with AVX512-BF16 / on GPUs: ~2x


@dataclass
class LoggerConfig:
    """conf/logger: where metrics go; W&B runs offline unless mode says otherwise."""

    name: str = MISSING
    project: str = "treedraft"
    mode: str = "offline"  # offline | online | disabled
    group: str | None = None  # null: the sweep's directory name under -m, else none
    dir: str | None = None  # null: the run's out_dir
    log_every: int = 10


@dataclass
class EvalConfig:
    """What the end-of-training evaluation runs on the held-out prompts."""

    num_prompts: int = 8
    max_new_tokens: int = 64
    top_k: int = 10  # ranks per head in the accuracy table the tree builder reads (Medusa)
    tree_budget: int = 16  # nodes of the tree the tau check decodes with
    depth: int = 5  # EAGLE: accuracy by draft depth 1..depth, and its EAGLE-2 tree's depth
    tree_top_k: int = 8  # EAGLE: the EAGLE-2 tree's top_k
    chain: int = 4  # draft model: the chain its tau check decodes


@dataclass
class TrainConfig:
    target: TargetConfig = MISSING
    drafter: Any = MISSING
    tree: Any = MISSING
    # Present even for a drafter with nothing to train (its data and optim files are optional),
    # so that an override of them composes and train.py can say there is nothing to train.
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    out_dir: str = MISSING
    resume: bool = True  # continue from out_dir's checkpoint when there is one
    save_every: int = 100  # steps between checkpoints
    device: str = "auto"  # auto: cuda when available, else cpu


def check_settings(cfg) -> None:
    """Refuse, before anything loads, settings a run cannot mean: ValueError naming the key."""
    counts = {"optim.max_steps": cfg.optim.max_steps, "save_every": cfg.save_every,
              "logger.log_every": cfg.logger.log_every}
    for key, value in counts.items():
        if value < 1:
            raise ValueError(f"{key} must be at least 1, got {value}")
    if cfg.optim.max_nonfinite_skips < 0:
        raise ValueError(f"optim.max_nonfinite_skips must be >= 0, got "
                         f"{cfg.optim.max_nonfinite_skips}")


def register_configs() -> None:
    """Make the schemas available to conf/train.yaml's defaults list (idempotent)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


register_configs()
