"""Result files of the experiment commands: the plot is written whole or not at all; a report
names the command that wrote it."""

import importlib
import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import matplotlib
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

import verify.runtime.model
from experiments.common import (
    CONF_DIR,
    check_report,
    file_stem,
    pick_questions,
    report_name,
    save_figure,
    write_report,
)
from verify.runtime.model import load_target, target_name

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the headless backend is chosen)


def test_a_failing_plot_leaves_the_earlier_png_whole(tmp_path, monkeypatch):
    path = tmp_path / "plot.png"
    save_figure(plt.figure(), path)
    earlier = path.read_bytes()
    assert earlier.startswith(b"\x89PNG")
    fig = plt.figure()

    def half_then_fail(out, **kwargs):  # as a kill in the middle of the write would
        (out.write if hasattr(out, "write") else open(out, "wb").write)(b"\x89PN")
        raise RuntimeError("killed")
    monkeypatch.setattr(fig, "savefig", half_then_fail)
    with pytest.raises(RuntimeError):
        save_figure(fig, path)
    assert path.read_bytes() == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_a_report_records_the_command_that_wrote_it(tmp_path, monkeypatch):
    """`python -m experiments.bench a=1` (torchrun's ranks run `-m` too) runs the module as
    __main__ with its name in the spec: the report keeps it and the arguments."""
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec("experiments.bench", None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/repo/experiments/bench.py", "drafter=eagle", "a=1"])
    path = write_report(tmp_path, "run", [{"x": 1}], OmegaConf.create({"a": "${b}", "b": 2}))
    report = json.loads(path.read_text())
    assert report["command"] == {"module": "experiments.bench", "argv": ["drafter=eagle", "a=1"]}
    assert report["config"] == {"a": 2, "b": 2} and report["rows"] == [{"x": 1}]
    main.__spec__ = None  # a script run by its path
    assert json.loads(write_report(tmp_path, "run", [], {"a": 1}).read_text())["command"] == {
        "module": "/repo/experiments/bench.py", "argv": ["drafter=eagle", "a=1"]}


@pytest.mark.parametrize("num_prompts, warmup", [(0, 1), (-2, 1), (4, -1)])
def test_prompt_counts_below_their_range_are_refused(num_prompts, warmup):
    # 0 prompts divided by zero at the end; a negative count sliced from the end, silently
    with pytest.raises(ValueError, match=f"num_prompts must be >= 1 and warmup >= 0, got "
                                         f"num_prompts={num_prompts}, warmup={warmup}"):
        pick_questions(None, num_prompts, warmup=warmup)
    assert len(pick_questions(None, 3, warmup=0)) == 3


def running(monkeypatch, module: str) -> None:
    """Make invocation() see `python -m <module>`."""
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.machinery.ModuleSpec(module, None)
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_a_report_is_named_by_the_target_that_loads_not_confs_name(tmp_path, monkeypatch):
    """target.path=B keeps conf's name (the default's): the report says B, as one file name
    inside out_dir, and the name is the loaded target's fingerprint name."""
    default = {"name": "smollm2-135m-instruct", "path": None, "tiny": None}
    assert report_name({"target": default}, "float32", "peers") == (
        "smollm2-135m-instruct-float32-peers")
    other = {**default, "path": "/models/B"}
    assert report_name({"target": other}, "float32", "peers") == "models-B-float32-peers"
    assert report_name({"target": {**default, "path": "org/Model-7B"}}, "suffix-reference") == (
        "org-Model-7B-suffix-reference")
    load_target(tiny="llama").model.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(verify.runtime.model.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    loaded = load_target(str(tmp_path / "model"))
    assert target_name(str(tmp_path / "model")) == loaded.fingerprint()["name"]
    assert report_name({"target": {"path": str(tmp_path / "model")}}, "x") == file_stem(
        f"{loaded.fingerprint()['name']}-x")
    assert target_name(tiny="qwen2") == load_target(tiny="qwen2").fingerprint()["name"]
    long = report_name({"target": {"path": "/m/" + "a" * 300}}, "peers")
    assert len(long) <= 120 and long != report_name({"target": {"path": "/m/" + "a" * 301}},
                                                    "peers")


def test_a_report_stays_inside_out_dir(tmp_path):
    with pytest.raises(ValueError, match="not a file name"):
        write_report(tmp_path / "out", f"{tmp_path}/model-suffix-reference", [], {})
    assert not list(tmp_path.rglob("*.json"))


def test_out_dir_is_checked_first_naming_it(tmp_path):
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(ValueError, match=f"out_dir={bad} is not a folder this command can "
                                             "write its report in"):
            check_report(bad, "r")
    assert check_report(tmp_path / "new", "r") == tmp_path / "new" / "r.json"
    assert (tmp_path / "new").is_dir()


def test_another_commands_report_is_not_overwritten(tmp_path, monkeypatch):
    """bench and batch_bench given one out_dir and the same methods: the second is refused
    before it runs (and batch_bench names its reports apart: methods.report_stem)."""
    running(monkeypatch, "experiments.bench")
    write_report(tmp_path, "tiny-llama-prompt_lookup-tree8", [], {})
    assert check_report(tmp_path, "tiny-llama-prompt_lookup-tree8")  # a rerun overwrites
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a script
    monkeypatch.setattr(sys, "argv", ["/repo/experiments/bench.py"])
    assert check_report(tmp_path, "tiny-llama-prompt_lookup-tree8")  # the same command
    running(monkeypatch, "experiments.batch_bench")
    with pytest.raises(ValueError, match=r"tiny-llama-prompt_lookup-tree8.json is "
                                         r"experiments.bench's report; experiments.batch_bench "
                                         r"would overwrite it"):
        check_report(tmp_path, "tiny-llama-prompt_lookup-tree8")


def test_a_setting_a_name_leaves_unsaid_is_not_overwritten(tmp_path, monkeypatch):
    """A report named before names said the temperature and the step (one made at
    temperature 1 on the OpenVINO step has the default's name): a run at the defaults is
    refused, naming both; the same settings replace it; the name says what is not default,
    once (peers says its dtype itself)."""
    running(monkeypatch, "experiments.bench")
    target = {"path": None, "tiny": "llama", "step": "openvino", "dtype": "float32"}
    write_report(tmp_path, "tiny-llama-x", [], {"target": target, "temperature": 1.0})
    default = {"target": {**target, "step": "eager"}, "temperature": 0.0}
    with pytest.raises(ValueError, match=r"tiny-llama-x.json is a report made with "
                                         r"target.step=openvino, temperature=1.0; this run "
                                         r"\(target.step=eager, temperature=0.0\) would "
                                         "overwrite it"):
        check_report(tmp_path, "tiny-llama-x", default)
    assert check_report(tmp_path, "tiny-llama-x", {"target": target, "temperature": 1})
    assert report_name({"target": target, "temperature": 1.0}, "x") == "tiny-llama-x-openvino-t1"
    bf16 = {"target": {**target, "step": "eager", "dtype": "bfloat16"}}
    assert report_name(bf16, "bfloat16", "peers") == "tiny-llama-bfloat16-peers"


COMMANDS = ["bench", "batch_bench", "context_sweep", "correctness", "distill_speed", "peers",
            "profile", "runs_table", "served", "simulate", "step_limit", "suffix_reference",
            "tree_search"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_checks_its_out_dir_before_any_work(tmp_path, monkeypatch, command):
    """A file given as out_dir fails at once, naming it, not after the run."""
    def no_work(*args, **kwargs):
        raise AssertionError("work started before out_dir was checked")

    module = importlib.import_module(f"experiments.{command}")
    monkeypatch.setattr(module, "load_target_from_config", no_work, raising=False)
    (tmp_path / "file").write_text("x")
    tiny = [] if command in ("runs_table", "simulate") else ["target=tiny_llama"]
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(command, [*tiny, f"out_dir={tmp_path / 'file'}"])
    with pytest.raises(ValueError, match="is not a folder this command can write"):
        module.main.__wrapped__(cfg)


ROOT = Path(CONF_DIR).parent


def simulate_sweep(tmp_path) -> dict[str, float]:
    """`python -m experiments.simulate -m alpha=0.6,0.7 ...` (the issue's sweep): each
    report's file name -> the alpha it holds."""
    subprocess.run([sys.executable, "-m", "experiments.simulate", "-m", "alpha=0.6,0.7",
                    "cost_ratio=0.05", f"out_dir={tmp_path / 'sim'}", "plot=false",
                    f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                   cwd=ROOT, capture_output=True, text=True, check=True)
    return {p.name: json.loads(p.read_text())["config"]["alpha"]
            for p in (tmp_path / "sim").glob("*.json")}


def test_each_job_of_a_sweep_keeps_its_report_and_a_rerun_replaces_them(tmp_path):
    """Both jobs wrote simulate.json: the sweep kept only the last one's."""
    first = simulate_sweep(tmp_path)
    assert sorted(first.values()) == [0.6, 0.7]
    assert simulate_sweep(tmp_path) == first  # the same sweep again: no refusal, no new files


@pytest.fixture
def sweep_job():
    """compose(command, overrides) as Hydra sets up one job of a `-m` sweep (HydraConfig in
    multirun mode, the job's overrides); HydraConfig cleared afterwards."""
    def job(command: str, *overrides: str):
        with initialize_config_dir(CONF_DIR, version_base=None):
            cfg = compose(command, list(overrides), return_hydra_config=True)
        cfg.hydra.mode = RunMode.MULTIRUN
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg
    yield job
    HydraConfig.instance().cfg = None


def test_two_jobs_of_a_sweep_get_two_names(sweep_job):
    """`bench -m max_new_tokens=8,16`: both jobs' reports were named by target and methods."""
    from experiments.methods import report_stem

    with initialize_config_dir(CONF_DIR, version_base=None):
        alone = report_stem(compose("bench", ["target=tiny_llama", "out_dir=/tmp/unused"]))
    names = {report_stem(sweep_job("bench", "target=tiny_llama", f"max_new_tokens={n}",
                                   "out_dir=/tmp/unused", "plot=false")) for n in (8, 16)}
    assert names == {f"{alone}-max_new_tokens-8-target-tiny_llama",
                     f"{alone}-max_new_tokens-16-target-tiny_llama"}


def test_a_setting_outside_the_name_is_not_overwritten(tmp_path, monkeypatch):
    """max_new_tokens (bench), another runs= list (learning_curves): the name says neither,
    and a rerun replaced the report; the same settings, or another plot=, still replace."""
    for command, made, other in (("bench", "max_new_tokens=8", "max_new_tokens=16"),
                                 ("learning_curves", "runs=[a]", "runs=[b]")):
        running(monkeypatch, f"experiments.{command}")
        with initialize_config_dir(CONF_DIR, version_base=None):
            cfg, same, changed = (compose(command, ["target=tiny_llama"] * (command == "bench")
                                          + overrides) for overrides in
                                  ([made], [made, "plot=false"], [other]))
        write_report(tmp_path, command, [], cfg)
        assert check_report(tmp_path, command, same) == tmp_path / f"{command}.json"
        key = made.split("=")[0]
        with pytest.raises(ValueError, match=rf"{command}\.json is a report made with {key}="):
            check_report(tmp_path, command, changed)
