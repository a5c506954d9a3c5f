"""experiments.regenerate: the command composes, and its report is what the results pages read
and render with the command's own table. (The regeneration itself: tests/train/
test_regenerate.py.)"""

import json

import pytest
from hydra import compose, initialize_config_dir

from experiments.regenerate import CONF_DIR, format_account, format_table, write_account_report
from experiments.results import kind_of
from tests.train.test_regenerate import chat_target, conversation, run
from train.regenerate import RegenConfig


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
