"""experiments.regenerate: the command composes, and its report is what the results pages read
and render with the command's own table. (The regeneration itself: tests/train/
test_regenerate.py.)"""

import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import experiments.regenerate as regenerate_command
from experiments.regenerate import CONF_DIR, format_account, format_table, write_account_report
from experiments.results import kind_of
from tests.train.test_regenerate import REGEN, FakeRanks, chat_target, conversation, run, written
from train.regenerate import RegenConfig, regenerate, regeneration_folder

HERE = Path(__file__).resolve().parent


def test_the_report_names_its_command_and_renders_as_the_account(tmp_path):
    target = chat_target()
    long_prompt = ("long", [{"from": "human", "value": " ".join(["w30"] * 80)},
                            {"from": "gpt", "value": "w1"}])
    no_answer = ("empty", [{"from": "gpt", "value": "w40"}, {"from": "human", "value": "w41"}])
    account = run(target, [conversation(0), conversation(1), long_prompt, no_answer], tmp_path)
    path = write_account_report(tmp_path, target, RegenConfig(), account)
    report = json.loads(path.read_text())
    assert path == tmp_path / "report.json" and report["rows"] == [account]
    assert report["environment"]["cpu_count"] and report["config"]["target"]["name"] == target.name
    assert set(report["command"]) == {"module", "argv"}
    recorded = {**report, "command": {"module": "experiments.regenerate", "argv": []}}
    assert kind_of(recorded, path).formatter == "experiments.regenerate:format_table"
    assert "| 4 | 2 | 2 (1 too long, 1 empty) | 0 (none) |" in format_table(report["rows"])
    assert format_account(account).startswith("input 4 = done 2 + skipped 2 (1 too long, 1 "
                                              "empty) + failed 0 (none)")


def test_the_command_and_the_data_option_compose():
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("regenerate", ["regen.conversations=8", "target.dtype=bfloat16"])
        assert cfg.regen.conversations == 8 and cfg.target.name == "smollm2-135m-instruct"
        with pytest.raises(Exception):
            compose("regenerate", ["regen.conversation=8"])  # misspelt: refused
        train_cfg = compose("train", ["drafter=eagle3", "data=regenerated",
                                      "data.conversations=/some/folder"])
        assert train_cfg.data.name == "regenerated"
        assert train_cfg.data.conversations == "/some/folder"


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """regen.engine=vllm served by the fake server (fake_vllm_server.py) in an environment
    whose python is this one; returns the RegenConfig settings that pick it."""
    monkeypatch.setitem(regenerate_command.ENGINE_SERVERS, "vllm", HERE / "fake_vllm_server.py")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (venv / "python").chmod(0o755)
    return {"engine": "vllm", "engine_venv": str(tmp_path / "venv")}


def regenerate_with_engine(target, records, folder, engine_settings):
    regen = RegenConfig(**{**REGEN, **engine_settings})
    with regenerate_command.EngineAnswers(target, "float32", regen) as answer:
        return regenerate(target, records, regen, folder, FakeRanks(0, 1, torch.device("cpu")),
                          answer)


def test_an_engine_gives_the_builtin_loops_files_and_the_comparison_says_so(tmp_path,
                                                                             fake_vllm):
    target = chat_target()
    records = [conversation(i, answers=2) for i in range(3)]
    builtin = run(target, records, tmp_path / "builtin")
    engine = regenerate_with_engine(target, records, tmp_path / "engine", fake_vllm)
    assert written(tmp_path / "engine") == written(tmp_path / "builtin")
    # the accounts agree but for this run's own record and the hours each took (the engine's
    # start-up can pass 1.8 s, 0.001 h once rounded)
    def account(a):
        return {k: v for k, v in a.items() if k not in ("this_run", "all_runs")}

    assert account(engine) == account(builtin)
    assert engine["all_runs"]["runs"] == builtin["all_runs"]["runs"] == 1
    assert engine["this_run"]["engine"] == "vllm" and builtin["this_run"]["engine"] == "builtin"
    compared = regenerate_command.compare_folders(tmp_path / "engine", tmp_path / "builtin",
                                                  target, records)
    assert compared["identical"] == compared["conversations"] == 3
    assert "first_divergence" not in compared
    assert "3 of 3 conversations identical" in format_account({**engine,
                                                               "compared_to": compared})


def test_a_divergence_is_found_with_its_margin_and_a_dead_engine_says_why(
        tmp_path, fake_vllm, monkeypatch):
    target = chat_target()
    records = [conversation(i, answers=2) for i in range(2)]
    run(target, records, tmp_path / "builtin")
    monkeypatch.setenv("FAKE_VLLM", "shift")
    regenerate_with_engine(target, records, tmp_path / "engine", fake_vllm)
    compared = regenerate_command.compare_folders(tmp_path / "engine", tmp_path / "builtin",
                                                  target, records)
    assert compared["identical"] < compared["conversations"]
    first = compared["first_divergence"]
    assert (first["id"], first["turn"], first["token_index"]) == ("c0", 1, 1)
    assert first["top1"] == first["theirs"] != first["ours"]  # the target's greedy token
    assert first["margin"] < 0  # ours (the shifted one) scores below the target's choice
    monkeypatch.setenv("FAKE_VLLM", "die")
    with pytest.raises(RuntimeError, match="ValueError: the model type llama is not supported"):
        regenerate_with_engine(target, records, tmp_path / "dead", fake_vllm)


def test_an_engine_is_part_of_the_folders_key_and_an_unknown_one_is_refused():
    target = chat_target()
    builtin = regeneration_folder(RegenConfig(), target, {"input": 1})
    assert regeneration_folder(RegenConfig(engine="vllm"), target, {"input": 1}) != builtin
    assert regeneration_folder(RegenConfig(engine_venv="/elsewhere"), target,
                               {"input": 1}) == builtin
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("regenerate", ["regen.engine=sglang"])
    with pytest.raises(ValueError, match="regen.engine='sglang': choose from"):
        regenerate_command.run(cfg)


VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="make peers installs .venv-peers/vllm")
def test_vllm_regenerates_the_default_targets_answers_as_the_builtin_loop(tmp_path):
    """regen.engine=vllm on the default target, greedy float32: four conversations' answers
    equal the built-in loop's (~4 min: vLLM's start-up compiles)."""
    settings = ["regen.conversations=4", "regen.max_new_tokens=24", "regen.batch_size=4"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        builtin = compose("regenerate", [*settings, f"regen.out_dir={tmp_path / 'builtin'}"])
        engine = compose("regenerate", [*settings, f"regen.out_dir={tmp_path / 'vllm'}",
                                        "regen.engine=vllm",
                                        f"compare_to={tmp_path / 'builtin'}"])
    regenerate_command.run(builtin)
    account = regenerate_command.run(engine)
    assert account["this_run"]["engine"] == "vllm"
    compared = account["compared_to"]
    assert compared["identical"] == compared["conversations"] == account["done"] > 0, compared


@pytest.mark.parametrize("behaviour, timeout_s, error", [
    ("mute", 2, r"vLLM gave no answer within 2 s \(timeout_s\): stopped"),
    ("chatty", 120, r"vLLM wrote a line that is not a JSON answer: 'INFO: a log line.*stopped")])
def test_a_server_that_never_answers_or_writes_no_json_is_stopped_with_a_clear_error(
        tmp_path, fake_vllm, monkeypatch, behaviour, timeout_s, error):
    monkeypatch.setenv("FAKE_VLLM", behaviour)
    target = chat_target()
    regen = RegenConfig(**{**REGEN, **fake_vllm})
    engine = regenerate_command.EngineAnswers(target, "float32", regen, timeout_s=timeout_s)
    with pytest.raises(RuntimeError, match=error):
        with engine as answer:
            regenerate(target, [conversation(0)], regen, tmp_path,
                       FakeRanks(0, 1, torch.device("cpu")), answer)
    assert engine.server.poll() is not None  # not left running


def test_a_missing_comparison_folder_is_refused_before_anything_loads(tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the target loaded before compare_to was checked")

    monkeypatch.setattr(regenerate_command, "load_target_from_config", no_work)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("regenerate", [f"regen.out_dir={tmp_path / 'out'}",
                                     f"compare_to={tmp_path / 'no' / 'such'}"])
    with pytest.raises(ValueError, match=r"compare_to=.*no/such: .*conversations.jsonl "
                                         "missing"):
        regenerate_command.run(cfg)
    assert not (tmp_path / "out").exists()
