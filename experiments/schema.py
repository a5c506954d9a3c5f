"""Typed schemas of the experiment commands, registered in Hydra's ConfigStore.

Each conf/<command>.yaml names `<command>_schema` first in its defaults, so every YAML value and
every command-line override is merged into these dataclasses and type-checked at composition:
`batch_bench max_batch_for_speculation=abc` fails naming the key before anything loads, as
train/schema.py does for training. The YAML files hold the values (and say what each key
means); the schemas hold only the types, so a field without a default (MISSING) takes its value
from the command's YAML and there is one copy of each default. The `drafter` and `tree` groups
hold different keys per option, so they stay open here; each drafter checks its own keys.

Importing the `experiments` package registers them (experiments/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from train.regenerate import RegenConfig
from train.schema import (
    DataConfig,
    DistConfig,
    EvalConfig,
    LoggerConfig,
    OptimConfig,
    TargetConfig,
    TrainConfig,
)


@dataclass
class BenchConfig:
    """conf/bench.yaml (experiments.bench); batch_bench and context_sweep build on it."""

    target: TargetConfig = MISSING
    drafter: Any = MISSING
    tree: Any = MISSING
    logger: LoggerConfig = MISSING
    data_root: str | None = MISSING
    categories: list[str] | None = MISSING
    num_prompts: int = MISSING
    max_new_tokens: int = MISSING
    warmup: int = MISSING
    repeats: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    top_k: int = MISSING
    seed: int = MISSING
    compare: list[str] = MISSING
    kept: str | None = None  # a training run's out_dir: each draft it kept joins drafter=/tree=
    peers: list[str] = MISSING
    reference: str | None = MISSING
    hf_prompt_lookup_num_tokens: int = MISSING
    hf_assistant_num_layers: int | None = MISSING
    hf_assistant_path: str | None = MISSING
    out_dir: str = MISSING
    pad_rows: int = MISSING
    loop_attention: str | None = MISSING
    plot: bool = MISSING
    # The presets' trained drafters (conf/experiment/bench/: checkpoints.eagle=<run>/checkpoint),
    # which their drafter and compare entries interpolate; none by default
    checkpoints: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchBenchConfig(BenchConfig):
    """conf/batch_bench.yaml (experiments.batch_bench)."""

    batch_sizes: list[int] = MISSING
    row_by_row: bool = MISSING
    max_batch_for_speculation: int | None = MISSING


@dataclass
class ContextSweepConfig(BenchConfig):
    """conf/context_sweep.yaml (experiments.context_sweep)."""

    lengths: list[int] = MISSING
    sizes: list[int] = MISSING
    cost_repeats: int = MISSING


@dataclass
class GreedyCheckConfig:
    num_prompts: int = MISSING
    max_new_tokens: int = MISSING
    pad_rows: int = MISSING
    reference: str | None = MISSING


@dataclass
class DistributionCheckConfig:
    enabled: bool = MISSING
    arch: str = MISSING
    vocab_size: int = MISSING
    seed: int = MISSING
    prompt_length: int = MISSING
    prompt_period: int = MISSING
    length: int = MISSING
    samples: int = MISSING
    batch_size: int = MISSING
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING
    alpha: float = MISSING
    rules: list[str] | None = None  # the rules checked (each with its control); None: all
    drafter_overrides: dict[str, Any] = MISSING  # keys of whichever drafter is checked


@dataclass
class ChainCheckConfig:
    enabled: bool = MISSING
    arch: str = MISSING
    seed: int = MISSING
    gamma: int = MISSING
    alphas: list[float] = MISSING
    prompts: int = MISSING
    max_new_tokens: int = MISSING
    tolerance_sigmas: float = MISSING


@dataclass
class CorrectnessConfig:
    """conf/correctness.yaml (experiments.correctness)."""

    target: TargetConfig = MISSING
    drafter: Any = MISSING
    tree: Any = MISSING
    data_root: str | None = MISSING
    out_dir: str = MISSING
    greedy: GreedyCheckConfig = field(default_factory=GreedyCheckConfig)
    distribution: DistributionCheckConfig = field(default_factory=DistributionCheckConfig)
    chain: ChainCheckConfig = field(default_factory=ChainCheckConfig)


@dataclass
class DistillSpeedConfig:
    """conf/distill_speed.yaml (experiments.distill_speed)."""

    target: TargetConfig = MISSING
    steps: list[str] = MISSING
    data_root: str | None = MISSING
    sources: list[str] = MISSING
    seed: int = MISSING
    num_prompts: int = MISSING
    batch_size: int = MISSING
    max_prompt_tokens: int = MISSING
    max_new_tokens: int = MISSING
    out_dir: str = MISSING


@dataclass
class ExportConfig:
    """conf/export.yaml (experiments.export)."""

    target: TargetConfig = MISSING
    checkpoint: str | None = MISSING
    format: str = MISSING
    out: str | None = MISSING
    speculative_tokens: int = MISSING
    verifier: str | None = MISSING
    embedding: bool = MISSING
    mask_token_id: int | None = MISSING
    tolerance: float = MISSING


@dataclass
class PeersConfig:
    """conf/peers.yaml (experiments.peers)."""

    target: TargetConfig = MISSING
    data_root: str | None = MISSING
    categories: list[str] | None = MISSING
    num_prompts: int = MISSING
    max_new_tokens: int = MISSING
    warmup: int = MISSING
    max_model_len: int = MISSING
    treedraft: list[str] = MISSING
    venvs: str = MISSING
    # {engine: its settings}; open here, so that `+engines.<name>=...` adds one: each is typed
    # by experiments.engines.EngineConfig before anything loads
    engines: dict[str, Any] = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class ServedConfig:
    """conf/served.yaml (experiments.served)."""

    target: TargetConfig = MISSING
    drafts: dict[str, str | None] = MISSING
    speculative_tokens: int = MISSING
    data_root: str | None = MISSING
    categories: list[str] | None = MISSING
    num_prompts: int = MISSING
    max_new_tokens: int = MISSING
    warmup: int = MISSING
    max_model_len: int = MISSING
    venv: str = MISSING
    timeout_s: float = MISSING
    memory_fraction: float = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class ProfileConfig:
    """conf/profile.yaml (experiments.profile)."""

    target: TargetConfig = MISSING
    sizes: list[int] = MISSING
    context_len: int = MISSING
    repeats: int = MISSING
    loop_steps: int = MISSING
    attn_implementations: list[str] = MISSING
    packings: list[Any] = MISSING  # target.packed_rows values: null, "auto" or lists of rows
    products: bool = MISSING
    seed: int = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class RegenerateConfig:
    """conf/regenerate.yaml (experiments.regenerate): train.regenerate.RegenConfig's settings,
    whose defaults are its own."""

    target: TargetConfig = MISSING
    regen: RegenConfig = field(default_factory=RegenConfig)
    device: str = "auto"
    compare_to: str | None = None  # another regeneration's folder: its answers compared
    report: str | None = None  # the report written here too (e.g. experiments/reports/...)


@dataclass
class OnpolicyDataConfig:
    """conf/onpolicy_data.yaml (experiments.onpolicy_data): the regeneration settings every
    way shares, the rows of each, and the engines."""

    target: TargetConfig = MISSING
    regen: RegenConfig = field(default_factory=RegenConfig)
    conversations: int = MISSING
    batch_size: int = MISSING
    batch_sizes: list[int] = MISSING
    engines: list[str] = MISSING
    out_dir: str = MISSING


@dataclass
class ReproduceConfig:
    """conf/reproduce.yaml (experiments.reproduce)."""

    paper: str = MISSING
    reports_dir: str = MISSING
    out_dir: str = MISSING


@dataclass
class ResultsConfig:
    """conf/results.yaml (experiments.results)."""

    src_dir: str = MISSING
    reports_dir: str = MISSING
    out_dir: str = MISSING
    check: bool = MISSING
    readme: str | None = MISSING


@dataclass
class RunsTableConfig:
    """conf/runs_table.yaml (experiments.runs_table)."""

    runs: Any = MISSING  # a folder, a list of folders or one eval.json
    x: str = MISSING
    series: str | None = MISSING
    where: list[str] = MISSING
    absent: list[str] = MISSING
    name: str = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class LearningCurvesConfig:
    """conf/learning_curves.yaml (experiments.learning_curves)."""

    runs: list[str] = MISSING
    name: str = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class ScaleRegenerateConfig:
    conversations: int = MISSING
    max_new_tokens: int = MISSING
    batch_size: int = MISSING
    dtype: str = MISSING


@dataclass
class ScaleTrainingConfig:
    drafters: list[str] = MISSING
    sharegpt_tokens: int = MISSING
    heldout_prompts: int = MISSING
    steps: int = MISSING


@dataclass
class ScaleSpeedConfig:
    """conf/scale_speed.yaml (experiments.scale_speed)."""

    target: TargetConfig = MISSING
    parts: list[str] = MISSING
    ranks: list[int] = MISSING
    target_option: str | None = MISSING
    port: int = MISSING
    regenerate: ScaleRegenerateConfig = field(default_factory=ScaleRegenerateConfig)
    training: ScaleTrainingConfig = field(default_factory=ScaleTrainingConfig)
    out_dir: str = MISSING


@dataclass
class SpeculatorsSideConfig:
    """conf/speculators_trainer.yaml's `speculators`: the library's side of the comparison."""

    venv: str = MISSING
    out_dir: str = MISSING
    loss_fn: str = MISSING
    loss_implementation: str = MISSING
    attention: str = MISSING
    loss_mask: str = MISSING
    train_lm_head: bool = MISSING
    timeout_s: float = MISSING


@dataclass
class SpeculatorsTrainerConfig(TrainConfig):
    """conf/speculators_trainer.yaml (experiments.speculators_trainer): conf/train.yaml's
    config, whose values it composes first (so every TrainConfig field is left MISSING here:
    a default would overwrite it), and the library's side."""

    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    eval: EvalConfig = MISSING
    dist: DistConfig = MISSING
    seed: int = MISSING
    resume: bool = MISSING
    save_every: int = MISSING
    device: str = MISSING
    speculators: SpeculatorsSideConfig = field(default_factory=SpeculatorsSideConfig)


@dataclass
class SimulateConfig:
    """conf/simulate.yaml (experiments.simulate)."""

    alpha: Any = MISSING  # a rate or a list of rates
    alpha_from: str | None = MISSING
    bench: str | None = MISSING
    costs: str | None = MISSING
    cost_ratio: float | None = MISSING
    draft_ms: float | None = MISSING
    gammas: list[int] = MISSING
    name: str = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class SuffixArcticConfig:
    max_tree_depth: int = MISSING
    memory: str = MISSING
    use_tree_spec: bool = MISSING


@dataclass
class SuffixCheckConfig:
    """One row of conf/suffix_reference.yaml's `checks`: its keys' defaults are here, a check
    naming only what it changes."""

    label: str = MISSING
    side: str = MISSING  # treedraft | arctic
    compare_to: str = "ArcticInference"
    note: str = ""
    drafter: dict[str, Any] = field(default_factory=dict)  # treedraft side: overrides
    tree: dict[str, Any] = field(default_factory=dict)
    whole_outputs: bool = False
    scoring: bool = False
    memory: str = "finished"  # finished | live
    arctic: dict[str, Any] = field(default_factory=dict)  # arctic side: overrides


@dataclass
class SuffixReferenceConfig:
    """conf/suffix_reference.yaml (experiments.suffix_reference)."""

    target: TargetConfig = MISSING
    drafter: Any = MISSING
    tree: Any = MISSING
    data_root: str | None = MISSING
    categories: list[str] | None = MISSING
    num_prompts: int = MISSING
    max_new_tokens: int = MISSING
    arctic: SuffixArcticConfig = field(default_factory=SuffixArcticConfig)
    arctic_venv: str = MISSING
    timeout_s: float = MISSING
    bootstrap: int = MISSING
    seed: int = MISSING
    checks: list[SuffixCheckConfig] = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class StepLimitConfig:
    """conf/step_limit.yaml (experiments.step_limit)."""

    target: TargetConfig = MISSING
    dtypes: list[str] = MISSING
    steps: list[str] = MISSING
    sizes: list[int] = MISSING
    context_len: int = MISSING
    repeats: int = MISSING
    operators: int = MISSING
    bandwidth_gib: float = MISSING
    bandwidth_repeats: int = MISSING
    venvs: str = MISSING
    optimum_timeout_s: float = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING


@dataclass
class TreeSearchConfig:
    """conf/tree_search.yaml (experiments.tree_search)."""

    target: TargetConfig = MISSING
    drafter: Any = MISSING
    # the drafter's training data (optional: suffix and hybrid have none, and mode=dynamic
    # then decodes self-distillation's held-out prompts)
    data: DataConfig | None = None
    mode: str = MISSING
    context_len: int = MISSING
    repeats: int = MISSING
    accuracies: str | None = MISSING  # a JSON file, or "decode"
    measure_depth: int = MISSING
    measure_top_k: int = MISSING
    sizes: list[int] = MISSING
    draft_cost_s: float = MISSING
    draft_depth_cost_s: float = MISSING
    max_depth: int | None = MISSING
    budgets: list[int] = MISSING
    depth: Any = MISSING  # an int or a list of them (every shape measured)
    top_k: Any = MISSING  # likewise
    num_prompts: int = MISSING
    max_new_tokens: int = MISSING
    name: str = MISSING
    tree_names: dict[str, str] = MISSING
    out: str = MISSING
    out_dir: str = MISSING
    plot: bool = MISSING
    seed: int = MISSING


SCHEMAS = {
    "batch_bench": BatchBenchConfig,
    "bench": BenchConfig,
    "context_sweep": ContextSweepConfig,
    "correctness": CorrectnessConfig,
    "distill_speed": DistillSpeedConfig,
    "export": ExportConfig,
    "learning_curves": LearningCurvesConfig,
    "onpolicy_data": OnpolicyDataConfig,
    "peers": PeersConfig,
    "profile": ProfileConfig,
    "regenerate": RegenerateConfig,
    "reproduce": ReproduceConfig,
    "results": ResultsConfig,
    "runs_table": RunsTableConfig,
    "scale_speed": ScaleSpeedConfig,
    "served": ServedConfig,
    "simulate": SimulateConfig,
    "speculators_trainer": SpeculatorsTrainerConfig,
    "step_limit": StepLimitConfig,
    "suffix_reference": SuffixReferenceConfig,
    "tree_search": TreeSearchConfig,
}


def register_configs() -> None:
    """Make `<command>_schema` available to each conf/<command>.yaml's defaults (idempotent)."""
    store = ConfigStore.instance()
    for command, schema in SCHEMAS.items():
        store.store(name=f"{command}_schema", node=schema)


register_configs()
