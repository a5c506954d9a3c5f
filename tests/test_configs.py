"""Every shipped config composes, and every config group option works with every command that
uses the group."""

import importlib.util
import logging
import re
import sys
from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments  # noqa: F401  (registers the <command>_schema nodes conf/<command>.yaml name)
import train.schema  # noqa: F401  (registers train_schema, which conf/train.yaml builds on)
from drafters.trees import tree_policy
from drafters.trees.confidence import ConfidenceChain
from drafters.trees.cost import measured_cost
from experiments.common import CONF_DIR
from experiments.methods import contenders, parse_compare, report_stem
from verify.runtime.model import load_target, load_target_from_config
from verify.runtime.step import STEPS
from verify.tree import TreeTopology

GROUPS = {group: sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
          for group in ("target", "drafter", "tree", "data", "optim", "logger", "experiment")}
# The groups each command's defaults list names.
COMMANDS = {
    "correctness": ("target", "drafter", "tree"),
    "bench": ("target", "drafter", "tree", "logger"),
    "context_sweep": ("target", "drafter", "tree"),
    "batch_bench": ("target", "drafter", "tree"),
    "export": ("target",),
    "profile": ("target",),
    "peers": ("target",),
    "served": ("target",),
    "speculators_trainer": ("target", "drafter", "data", "optim", "logger", "experiment"),
    "train": ("target", "drafter", "data", "optim", "logger", "experiment"),
    "tree_search": ("target", "drafter"),
    "runs_table": (),
    "learning_curves": (),
    "simulate": (),
    "reproduce": (),
    "step_limit": ("target",),
    "suffix_reference": ("target", "drafter", "tree"),
    "distill_speed": ("target",),
    "regenerate": ("target",),
    "onpolicy_data": ("target",),
    "scale_speed": ("target",),
    "results": (),
}
# Benchmark presets live in conf/experiment/bench/ (experiment=bench/<name>); the top-level
# experiment options are train.py's.
BENCH_PRESETS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment" / "bench").glob("*.yaml"))
# Regeneration presets: conf/experiment/regenerate/
# (python -m experiments.regenerate experiment=...)
REGENERATE_PRESETS = sorted(
    p.stem for p in (Path(CONF_DIR) / "experiment" / "regenerate").glob("*.yaml"))
CASES = [(command, group, option) for command, groups in COMMANDS.items()
         for group in groups for option in GROUPS[group]]


def compose_with(command, *overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(command, list(overrides))


def test_every_group_is_used_and_every_config_file_is_a_command_or_an_option():
    assert set(GROUPS) == {g for groups in COMMANDS.values() for g in groups}
    top_level = {p.stem for p in Path(CONF_DIR).glob("*.yaml")}
    assert top_level == set(COMMANDS) | {"hydra_files"}  # the one every command's list holds


@pytest.mark.parametrize("command, group, option", CASES)
def test_every_group_option_composes_with_every_command_using_it(command, group, option):
    # export writes one folder, `out=` (the issue's spelling); the others a results tree
    # (regenerate's folder is regen.out_dir)
    where = {"export": "out=/tmp/unused", "regenerate": "regen.out_dir=/tmp/unused"}.get(
        command, "out_dir=/tmp/unused")
    cfg = compose_with(command, f"{group}={option}", where)
    # every option names itself for result tables and file names (presets change others)
    assert group == "experiment" or cfg[group].name


@pytest.mark.parametrize("tree", GROUPS["tree"])
def test_tree_configs_are_valid_tree_policies(tree):
    cfg = compose_with("bench", f"tree={tree}")
    # a cost measured on the target (tree=adaptive) needs one: the tiny Llama here
    policy = tree_policy(measured_cost(cfg.tree, load_target(tiny="llama").model))
    if isinstance(policy, TreeTopology):
        assert policy.size - 1 == len(cfg.tree.choices)
    elif isinstance(policy, ConfidenceChain):  # a chain as deep as the block, cut by cost
        assert policy.depth == cfg.tree.depth and policy.cost is not None
    else:
        assert policy.total_tokens == cfg.tree.total_tokens


@pytest.mark.parametrize("target", [t for t in GROUPS["target"] if t.startswith("tiny")])
def test_tiny_target_configs_load(target):
    cfg = compose_with("bench", f"target={target}")
    assert load_target_from_config(cfg.target).model.config.vocab_size == 256


def test_step_options_reach_the_step_typed_and_a_step_refuses_ones_it_does_not_take():
    cfg = compose_with("bench", "target=tiny_llama", "target.step=openvino",
                       "target.step_options.threads=1")
    assert load_target_from_config(cfg.target).step.threads == 1
    with pytest.raises(ValueError, match=r"target.step=eager takes no options \['threads'\]"):
        load_target_from_config(compose_with("bench", "target=tiny_llama",
                                             "target.step_options.threads=1").target)
    with pytest.raises(Exception, match="threads"):  # typed: a count, not a word
        compose_with("bench", "target.step_options.threads=two")


def test_the_train_schema_type_checks_overrides():
    with pytest.raises(Exception, match="optim.lr"):
        compose_with("train", "optim.lr=fast")
    with pytest.raises(Exception, match="nope"):
        compose_with("train", "data.nope=1")


# For each experiment command, a value of the wrong type for one of its keys, and that key: a
# wrongly typed value fails at composition naming the key (experiments/schema.py), not deep in
# the run (issue 36: `batch_bench max_batch_for_speculation=abc` raised a raw TypeError).
WRONGLY_TYPED = {
    "batch_bench": ("max_batch_for_speculation=abc", "max_batch_for_speculation"),
    "bench": ("num_prompts=many", "num_prompts"),
    "context_sweep": ("lengths=[128,long]", "lengths"),
    "correctness": ("distribution.samples=lots", "distribution.samples"),
    "distill_speed": ("batch_size=big", "batch_size"),
    "export": ("speculative_tokens=three", "speculative_tokens"),
    "learning_curves": ("plot=perhaps", "plot"),
    "peers": ("max_model_len=huge", "max_model_len"),
    "profile": ("products=maybe", "products"),
    "regenerate": ("regen.temperature=warm", "regen.temperature"),
    "onpolicy_data": ("batch_sizes=[16,lots]", "batch_sizes"),
    "reproduce": ("paper=[eagle,medusa]", "paper"),
    "results": ("check=sometimes", "check"),
    "runs_table": ("plot=perhaps", "plot"),
    "scale_speed": ("training.steps=forty", "training.steps"),
    "served": ("speculative_tokens=three", "speculative_tokens"),
    "simulate": ("cost_ratio=small", "cost_ratio"),
    "speculators_trainer": ("speculators.train_lm_head=sometimes", "speculators.train_lm_head"),
    "step_limit": ("bandwidth_gib=one", "bandwidth_gib"),
    "suffix_reference": ("bootstrap=many", "bootstrap"),
    "tree_search": ("draft_cost_s=free", "draft_cost_s"),
}


def test_every_experiment_command_is_typed():
    assert set(WRONGLY_TYPED) == set(COMMANDS) - {"train"}  # train: train/schema.py's own test


@pytest.mark.parametrize("command", sorted(WRONGLY_TYPED))
def test_every_experiment_command_refuses_a_wrongly_typed_value_naming_the_key(command):
    override, key = WRONGLY_TYPED[command]
    with pytest.raises(Exception) as refused:
        compose_with(command, override)
    # Hydra wraps OmegaConf's ValidationError: a type error (not an unknown key) naming the key
    message = f"{refused.value}\n{refused.value.__cause__}"
    assert f"full_key: {key}" in message and "not in struct" not in message, message


@pytest.mark.parametrize("command", sorted(WRONGLY_TYPED))
def test_every_experiment_command_composes_complete_and_typed(command):
    # every key the schema types has its value in the command's YAML (the one copy of it)
    # (speculators_trainer's folders are named by Hydra's override_dirname, as train.py's:
    # resolved under Hydra's runner only)
    given = {"runs_table": ["runs=[a]", "x=data.sharegpt_tokens"],
             "learning_curves": ["runs=[a]"],
             "speculators_trainer": ["out_dir=/tmp/unused", "speculators.out_dir=/tmp/unused"]
             }.get(command, [])
    cfg = compose_with(command, *given)
    assert OmegaConf.get_type(cfg).__name__.lower().replace("_", "") == (
        command.replace("_", "") + "config")
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_a_misspelt_experiment_key_is_refused():
    with pytest.raises(Exception, match="max_batch_for_speculaton"):
        compose_with("batch_bench", "max_batch_for_speculaton=2")


def _train_entry():
    # `import train` finds the train/ package: load the root script by its path
    spec = importlib.util.spec_from_file_location("train_entry", Path(CONF_DIR).parent / "train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry


@pytest.mark.parametrize("drafter, overrides", [
    ("prompt_lookup", []), ("suffix", []), ("hybrid", []),
    ("suffix", ["optim.lr=0.1", "data.num_prompts=3"]),  # an override of an absent group composes
])
def test_train_entry_says_when_a_drafter_has_nothing_to_train(drafter, overrides, capsys):
    # such a drafter has no data or optim files (conf/train.yaml's optional entries): the
    # schema's empty sections stand in
    cfg = compose_with("train", f"drafter={drafter}", "out_dir=/tmp/unused", *overrides)
    assert OmegaConf.is_missing(cfg.data, "name") and OmegaConf.is_missing(cfg.optim, "name")
    _train_entry().main(cfg)
    out = capsys.readouterr().out
    assert f"'{drafter}' has nothing to train" in out and "medusa" in out


def test_an_unknown_group_option_is_refused():
    with pytest.raises(Exception, match="nope"):
        compose_with("bench", "drafter=nope")


def test_the_runs_table_config_asks_for_its_runs_and_axis():
    cfg = compose_with("runs_table", "runs=[a]", "x=data.sharegpt_tokens")
    assert list(cfg.runs) == ["a"] and cfg.where == [] and cfg.series is None


@pytest.mark.parametrize("preset", GROUPS["experiment"])
def test_each_train_preset_says_how_to_run_it_and_its_sweep_composes(preset):
    text = (Path(CONF_DIR) / "experiment" / f"{preset}.yaml").read_text()
    assert f"experiment={preset}" in text.splitlines()[1]  # the command, under the package line
    cfg = compose_with("train", f"experiment={preset}", "out_dir=/tmp/unused")
    if "-m experiment=" in text.splitlines()[1]:
        # a sweep preset: each swept key exists in the composed config, with its values
        with initialize_config_dir(CONF_DIR, version_base=None):
            hydra_cfg = compose("train", [f"experiment={preset}"], return_hydra_config=True)
        params = hydra_cfg.hydra.sweeper.params
        assert params
        for key, values in params.items():
            assert OmegaConf.select(cfg, key, default="missing") != "missing", key
            assert len(str(values).split(",")) >= 2


@pytest.mark.parametrize("preset", BENCH_PRESETS)
def test_each_bench_preset_composes_and_names_the_checkpoints_it_needs(preset):
    with pytest.raises(Exception, match="checkpoints"):  # mandatory: a clear missing-value error
        OmegaConf.to_container(compose_with("bench", f"experiment=bench/{preset}"), resolve=True)
    needed = compose_with("bench", f"experiment=bench/{preset}").checkpoints
    given = [f"checkpoints.{name}=/runs/{name}" for name in needed]
    cfg = compose_with("bench", f"experiment=bench/{preset}", *given)
    entries = [parse_compare(e) for e in cfg.compare]  # every entry is well formed
    paths = {str(v) for c in entries for v in c.drafter.values()} | {
        str(v) for v in cfg.drafter.values()}
    assert {f"/runs/{name}" for name in needed} <= paths  # each checkpoint reaches a drafter


@pytest.mark.parametrize("preset", REGENERATE_PRESETS)
def test_each_regeneration_preset_says_how_to_run_it_and_composes(preset):
    text = (Path(CONF_DIR) / "experiment" / "regenerate" / f"{preset}.yaml").read_text()
    assert f"experiments.regenerate experiment=regenerate/{preset}" in text.splitlines()[1]
    assert all(word in text for word in ("Time:", "Memory:", "Disk:"))
    cfg = compose_with("regenerate", f"experiment=regenerate/{preset}")
    assert cfg.regen.conversations > 0 and cfg.target.name


def test_the_8b_presets_fit_together():
    """The regeneration preset feeds the training preset, whose draft the bench preset reads:
    one target, online features under FSDP2, the EAGLE-3 tree settings."""
    regen = compose_with("regenerate", "experiment=regenerate/llama8b")
    training = compose_with("train", "experiment=llama8b_eagle3", "data.conversations=/r")
    bench = compose_with("bench", "experiment=bench/llama8b", "checkpoints.eagle3=/c")
    assert regen.target.name == training.target.name == bench.target.name
    assert training.dist.strategy == "fsdp" and not training.data.cache_hidden
    assert training.data.name == "regenerated" and training.drafter.name == "eagle3"
    assert regen.regen.max_context_tokens == training.data.max_sequence_tokens
    assert (bench.tree.total_tokens, bench.tree.depth, bench.tree.top_k) == (60, 6, 10)
    header = (Path(CONF_DIR) / "experiment" / "llama8b_eagle3.yaml").read_text()
    assert all(word in header for word in ("Time:", "Memory:", "Disk:"))


def test_the_reproduce_preset_is_the_run_the_write_ups_read():
    cfg = compose_with("bench", "experiment=bench/reproduce", "checkpoints.draft=d",
                       "checkpoints.eagle=e", "checkpoints.medusa=m")
    names = [c.name for c in contenders(cfg)]
    assert names == ["draft_model/chain1", "draft_model/chain2", "draft_model/chain3",
                     "draft_model/chain4", "draft_model/chain6", "eagle/tree8",
                     "eagle/eagle2 (budget 8)", "medusa/chain4", "medusa/medusa_sparse4"]
    assert report_stem(cfg).startswith("smollm2-135m-instruct-draft_model-chain1+")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_hydra_writes_no_file_of_its_own(command, tmp_path, monkeypatch):
    """Run through Hydra's own runner, as `python -m experiments.<command>` is: no
    outputs/<date>/ in the current folder (no .hydra/ configs, no <job>.log), and the
    command runs where it was started."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [command])
    ran = []

    @hydra.main(config_path=CONF_DIR, config_name=command, version_base=None)
    def task(cfg):
        ran.append(Path.cwd())

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        task()
    finally:  # Hydra configured this process's logging for the job: put it back
        root.handlers[:], root.level = handlers, level
    assert ran == [tmp_path] and list(tmp_path.iterdir()) == []


# How a config's text lists the target steps: "eager | compiled | ... (verify/runtime/step.py
# STEPS)", the registry it must match
STEP_LIST = re.compile(r"((?:\w+ \| )+\w+) \(verify/runtime/step\.py STEPS\)")


@pytest.mark.parametrize("path", [*sorted(Path(CONF_DIR, "target").glob("*.yaml")),
                                  Path(train.schema.__file__)], ids=lambda p: p.name)
def test_every_description_of_target_step_lists_the_registered_steps(path):
    """conf/target/*.yaml and train/schema.py said "eager or compiled" after compiled_one_graph
    and openvino had joined verify.runtime.step.STEPS."""
    text = path.read_text()
    listed = [found.split(" | ") for found in STEP_LIST.findall(text)]
    assert listed and all(names == list(STEPS) for names in listed), (path, listed)
