"""The weight-streaming limit: the bytes a step reads, the bandwidth, and the table."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.common import CONF_DIR
from experiments.step_limit import (
    format_table,
    kv_bytes,
    limit_row,
    plot,
    read_bandwidth,
    weight_bytes,
)
from verify.runtime.model import build_tiny_model


def _params(model) -> int:
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_step_reads_every_weight_but_the_unread_embedding_rows(arch):
    model = build_tiny_model(arch)
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    unread = 0 if tied else (embedding.shape[0] - 1) * embedding.shape[1]
    assert weight_bytes(model) == 4 * (_params(model) - unread)
    assert weight_bytes(model.to(torch.bfloat16)) == 2 * (_params(model) - unread)


def test_the_kv_cache_read_grows_with_the_context():
    model = build_tiny_model("llama")
    config = model.config
    per_position = (2 * config.num_hidden_layers * config.num_key_value_heads
                    * (config.hidden_size // config.num_attention_heads) * 4)
    assert kv_bytes(model, 100) == 100 * per_position
    assert kv_bytes(model, 0) == 0


def test_bandwidth_is_a_rate():
    assert 1e8 < read_bandwidth(gib=0.01, repeats=3) < 1e13


def test_a_row_puts_t_n_beside_the_limit(tmp_path):
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("step_limit", ["target=tiny_llama", "sizes=[1,2,8]", "context_len=16",
                                     "repeats=2"])
    row = limit_row(cfg, "float32", "eager", bandwidth=1e10)
    assert set(row["t_ms"]) == {1, 2, 8} and all(t > 0 for t in row["t_ms"].values())
    assert set(row["t_fixed_ms"]) == {1, 2, 8}  # sizes back to back: no change of size
    assert row["limit_ms"] == pytest.approx(1000 * (row["weight_bytes"] + row["kv_bytes"]) / 1e10)
    assert row["t1_over_limit"] == pytest.approx(row["t_ms"][1] / row["limit_ms"])
    saved = json.loads(json.dumps([row]))  # as read back from its JSON: string keys
    table = format_table(saved)
    assert "| float32 | eager |" in table and "t(8) ms" in table and "t(1) fixed ms" in table
    assert plot(saved, tmp_path / "limit.png").stat().st_size > 0
    cfg.operators = 3
    compiled = limit_row(cfg, "float32", "compiled", bandwidth=1e10)
    assert compiled["compile_s"] > 0 and set(compiled["t_ms"]) == {1, 2, 8}
    operators = compiled["operators_ms"]
    assert len(operators) == 4 and "other" in operators
    assert all(ms >= 0 for ms in operators.values())
    table = format_table(json.loads(json.dumps([row, compiled])))
    assert "| float32 | compiled |" in table and "float32, compiled step, n = 1" in table
    paged = limit_row(cfg, "float32", "openvino", bandwidth=1e10)
    assert set(paged["t_ms"]) == {1, 2, 8} and paged["compile_s"] is None
    # the plugin's own operator count: its products and its paged attention are named
    assert len(paged["operators_ms"]) == 4 and "other" in paged["operators_ms"]
    assert any(kind.startswith("FullyConnected") for kind in paged["operators_ms"])
    assert "float32, openvino step, n = 1 (the plugin's count)" in format_table([paged])
    with pytest.raises(ValueError, match="unknown step option 'fused'"):
        limit_row(cfg, "float32", "fused", bandwidth=1e10)
    with pytest.raises(ValueError, match="no packed step for float16"):
        limit_row(cfg, "float16", "packed", bandwidth=1e10)


@pytest.mark.parametrize("interleave, order", [(True, [1, 8, 1, 8, 1, 8]),
                                               (False, [1, 1, 1, 8, 8, 8])])
def test_sizes_take_turns_or_run_back_to_back(interleave, order, monkeypatch):
    import verify.costs as costs
    from verify.runtime.model import load_target

    seen = []
    monkeypatch.setattr(costs, "time_step", lambda verifier, tree: seen.append(len(tree)) or 1.0)
    cost = costs.measure_verify_cost(load_target(tiny="llama").step, [1, 8], 8, repeats=2,
                                     interleave=interleave)
    assert seen == order and cost == {1: 1.0, 8: 1.0}


def test_the_optimum_row_without_openvinos_environment_is_refused_before_anything_loads(
        tmp_path):
    from experiments.step_limit import optimum_python

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("step_limit", ["target=tiny_llama", "steps=[openvino,optimum]",
                                     f"venvs={tmp_path}"])
    with pytest.raises(ValueError, match=r"optimum step runs in OpenVINO's own environment.*"
                                         r"scripts/peers.sh openvino"):
        optimum_python(cfg)


def test_the_optimum_row_times_optimums_exported_graph(tmp_path):
    """The real runner, in the real environment: t(n) for each size, both orders."""
    from experiments.engines import REPO

    if not (REPO / ".venv-peers" / "openvino" / "bin" / "python").is_file():
        pytest.skip("OpenVINO's environment is not installed (bash scripts/peers.sh openvino)")
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("step_limit", ["target=tiny_llama", "steps=[optimum]", "sizes=[1,4]",
                                     "context_len=16", "repeats=2"])
    row = limit_row(cfg, "float32", "optimum", bandwidth=1e10)
    assert set(row["t_ms"]) == set(row["t_fixed_ms"]) == {1, 4}
    assert all(t > 0 for t in [*row["t_ms"].values(), *row["t_fixed_ms"].values()])
