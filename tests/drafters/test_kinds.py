"""drafters.kinds: what a folder holds, read from its config.json alone (no weights, no
target), for commands that refuse a folder of another kind before loading anything."""

import json

import pytest

from drafters.kinds import DESCRIPTIONS, checkpoint_kind
from verify.files import UnreadableFileError


@pytest.mark.parametrize("config, kind", [
    ({"drafter": "dflash", "feature_layers": [1, 2, 3], "target": {}}, "dflash"),
    ({"feature_layers": [1, 2, 3], "target": {}}, "eagle3"),
    ({"feature_layers": [1], "layout": "eagle3", "target": {}}, "eagle3"),
    ({"feature_layers": [1], "target": {}}, "eagle1"),  # older ones name no layout
    ({"num_heads": 3, "num_layers": 1, "target": {}}, "medusa"),
    ({"model_type": "llama", "vocab_size": 256}, "draft_model"),
    ({"model_type": "medusa", "num_heads": 3}, "vllm_medusa"),
    ({"speculators_model_type": "dflash"}, "speculators"),
    ({"something": "else"}, "unknown"),
])
def test_a_folder_s_kind_comes_from_its_config(tmp_path, config, kind):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_kind(tmp_path) == kind
    assert kind in DESCRIPTIONS


def test_a_run_folder_an_empty_one_and_a_broken_config(tmp_path):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "config.json").write_text('{"num_heads": 2, "target": {}}')
    assert checkpoint_kind(tmp_path / "run") == "run"
    assert checkpoint_kind(tmp_path) == "unknown"
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(UnreadableFileError, match="config.json"):
        checkpoint_kind(tmp_path)
