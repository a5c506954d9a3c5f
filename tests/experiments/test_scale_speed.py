"""experiments.scale_speed: every figure is read from what a real command wrote."""

import json

import pytest
from hydra import compose, initialize_config_dir

import experiments.scale_speed as scale_speed
from experiments.common import CONF_DIR


def test_rows_come_from_the_files_the_commands_write(tmp_path, monkeypatch):
    """The subprocesses are replaced by writers of the files they leave; the rows must carry
    those files' figures, and each part's command must be the real one."""
    commands = []

    def fake_run(args, scratch):
        commands.append(args)
        out = next(a.split("=", 1)[1] for a in args
                   if a.startswith(("regen.out_dir=", "out_dir=")))
        folder = tmp_path / out
        if "experiments.regenerate" in args:
            (folder).mkdir(parents=True)
            (folder / "account.json").write_text(json.dumps({"this_run": {
                "tokens": 640, "seconds": 8.0, "tokens_per_s": 80.0}}))
            return
        online = "data.cache_hidden=false" in args
        folder.mkdir(parents=True)
        ranks = 2 if "torch.distributed.run" in args else 1
        (folder / "eval.json").write_text(json.dumps({"training": {
            "ranks": ranks, "seconds": 4.0, "tokens_per_s": 50.0 if online else 200.0,
            "steps_per_s": 1.0}}))
        if not online:
            cache = tmp_path / next(a.split("=", 1)[1] for a in args
                                    if a.startswith("data.cache_dir=")) / "features" / "x"
            for name, tokens in (("held", 10), ("train", 3000)):
                (cache / name).mkdir(parents=True)
                (cache / name / "manifest.json").write_text(json.dumps({
                    "tokens": tokens, "layers": [30], "bytes_per_token": 1152,
                    "extracted": {"tokens": tokens, "seconds": 2.0,
                                  "tokens_per_s": tokens / 2}}))

    monkeypatch.setattr(scale_speed, "run", fake_run)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("scale_speed", ["training.drafters=[eagle]"])
    cfg.target_option = "smollm2"
    rows = scale_speed.evaluate(cfg, tmp_path)
    by_part = [(r["part"], r["ranks"], r["tokens_per_s"]) for r in rows]
    assert by_part == [("regenerate", 1, 80.0), ("regenerate", 2, 80.0),
                       ("features", 1, 1500.0), ("training", 1, 200.0), ("training", 1, 50.0),
                       ("features", 2, 1500.0), ("training", 2, 50.0)]
    assert rows[-1]["setting"] == "eagle, online, fsdp" and "dist.strategy=fsdp" in commands[-1]
    assert commands[1][:4] == [scale_speed.sys.executable, "-m", "torch.distributed.run",
                               "--nproc_per_node=2"]
    assert "-m" in commands[0] and "experiments.regenerate" in commands[0]
    assert "train.py" in commands[2] and "data.cache_hidden=false" in commands[3]
    assert "| regenerate |" in scale_speed.format_table(rows)


def test_an_unknown_part_is_refused(tmp_path):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("scale_speed", ["parts=[regen]"])
    with pytest.raises(ValueError, match="unknown parts"):
        scale_speed.evaluate(cfg, tmp_path)
