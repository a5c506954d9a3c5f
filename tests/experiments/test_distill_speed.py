"""experiments.distill_speed: self-distillation tokens/s per target step, on the same prompts."""

import json

from hydra import compose, initialize_config_dir

from experiments.common import CONF_DIR
from experiments.distill_speed import evaluate, format_table


def test_each_step_answers_the_same_prompts_and_is_compared_with_the_first(tmp_path):
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("distill_speed", ["target=tiny_llama", "num_prompts=4", "batch_size=2",
                                        "max_new_tokens=6", f"out_dir={tmp_path}"])
    rows = evaluate(cfg)
    assert [r["step"] for r in rows] == ["eager", "compiled"]
    for row in rows:
        assert row["prompts"] == 4 and row["tokens"] == 4 * 6  # tiny targets never stop early
        assert row["tokens_per_s"] > 0 and row["warmup_s"] > 0
    assert rows[0]["identical"] == 1.0
    assert 0.0 <= rows[1]["identical"] <= 1.0
    table = format_table(json.loads(json.dumps(rows)))
    assert "| compiled | float32 | 4 | 2 | 24 |" in table
