"""experiments.onpolicy_data: every way regenerates the same conversations, the continuous batch
with features; an engine without its environment is a "not run" row; the report renders."""

import json

import torch
from hydra import compose, initialize_config_dir

import experiments.onpolicy_data as onpolicy_data
from experiments.common import CONF_DIR
from experiments.results import kind_of
from tests.train.test_regen_continuous import on_openvino, records
from tests.train.test_regenerate import chat_target
from verify.runtime.model import Target


def tiny_targets(cfg, step, dtype, packed_rows):
    """The chat target of the regeneration tests, on the step and in the dtype asked."""
    target = chat_target()
    if dtype == "bfloat16":
        target = Target(target.model.to(torch.bfloat16), target.tokenizer, target.name)
    return on_openvino(target) if step == "openvino" else target


def test_every_way_on_the_same_conversations(tmp_path, monkeypatch):
    monkeypatch.setattr(onpolicy_data, "load_target_from_config", tiny_targets)
    monkeypatch.setattr(onpolicy_data, "regen_records", lambda regen: records())
    monkeypatch.setattr(onpolicy_data, "native_bfloat16", lambda: True)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("onpolicy_data", overrides=[
            f"out_dir={tmp_path}", "batch_size=3", "batch_sizes=[2,4]", "engines=[vllm]",
            f"regen.engine_venv={tmp_path / 'no-venv'}", "regen.max_new_tokens=6",
            "regen.max_context_tokens=64", "regen.step_tokens=16", "regen.feature_layers=[1]"])
    rows = onpolicy_data.run(cfg)
    names = [(row["name"], row["batch_size"]) for row in rows]
    assert names == [("builtin-eager-float32", 3), ("builtin-openvino-float32", 3),
                     ("builtin-openvino-bfloat16", 2), ("builtin-openvino-bfloat16", 4),
                     ("vllm", 3)]
    reference, fast32 = rows[0], rows[1]
    assert reference["batching"] == "rounds" and "feature_tokens" not in reference
    assert fast32["batching"] == "continuous" and fast32["feature_tokens"] > fast32["tokens"]
    # float32 kernels of another library, same greedy answers on the tiny target
    assert fast32["compared"]["identical"] == fast32["compared"]["conversations"] == len(records())
    assert all(row["tokens"] == reference["tokens"] for row in rows[1:2])
    assert "missing" in rows[-1]["error"]
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert report["rows"] == json.loads(json.dumps(rows))
    table = kind_of(report, tmp_path).render(report)
    assert "| vllm | 3 | not run:" in table and "| builtin-eager-float32 | 3 |" in table
