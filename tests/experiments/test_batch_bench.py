"""The batch benchmark on a tiny target: every batch size decodes every prompt as alone, the
figures add up, and settings it cannot honour are refused."""

import pytest
from hydra import compose, initialize_config_dir

from drafters import build_drafter
from experiments.batch_bench import (
    RowByRow,
    build_batch_methods,
    check_sizes,
    plot,
    run_batches,
)
from experiments.bench_report import format_batch_table
from experiments.common import CONF_DIR
from verify.loop import until_eos
from verify.protocol import BatchDrafter, Drafter
from verify.runtime.model import load_target_from_config


def batch_config(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("batch_bench", ["target=tiny_llama", "drafter=draft_model",
                                       "drafter.num_layers=1", "tree=chain4", "num_prompts=4",
                                       "max_new_tokens=8", "batch_sizes=[1,2,4]", *overrides])


def test_every_batch_size_decodes_every_prompt_as_alone(tmp_path):
    summary = run_batches(batch_config("compare=[prompt_lookup:tree8]"))
    assert list(summary["sizes"]) == [1, 2, 4]
    for size, methods in summary["sizes"].items():
        assert list(methods) == ["hf_greedy", "plain_loop", "draft_model/chain4",
                                 "prompt_lookup/tree8"]
        assert methods["hf_greedy"]["speedup"] == 1.0
        for name, figures in methods.items():
            assert figures["identical"] == 1.0, (size, name)  # HF's batched greedy too
            assert figures["new_tokens"] == 4 * 8
        assert methods["draft_model/chain4"]["tau"] >= 1.0
        assert 0 < methods["draft_model/chain4"]["draft_share"] < 1
    table = format_batch_table(summary)
    assert "| 4 | draft_model/chain4 |" in table
    assert plot(summary, tmp_path / "b.png").stat().st_size > 0


def test_row_by_row_times_each_batch_drafter_again_drafting_alone():
    summary = run_batches(batch_config("compare=[prompt_lookup:tree8]", "batch_sizes=[1,2]",
                                       "row_by_row=true"))
    methods = summary["sizes"][2]
    # prompt lookup has no batch methods: it drafts row by row already, and is not doubled
    assert list(methods) == ["hf_greedy", "plain_loop", "draft_model/chain4",
                             "draft_model/chain4 (row by row)", "prompt_lookup/tree8"]
    together, alone = methods["draft_model/chain4"], methods["draft_model/chain4 (row by row)"]
    assert alone["identical"] == together["identical"] == 1.0
    assert alone["tau"] == together["tau"]  # the same trees, drafted another way


def test_a_row_by_row_drafter_hides_the_batch_methods():
    cfg = batch_config()
    drafter = build_drafter(cfg.drafter, cfg.tree, load_target_from_config(cfg.target))
    assert isinstance(drafter, BatchDrafter)
    wrapped = RowByRow(drafter)
    assert isinstance(wrapped, Drafter) and not isinstance(wrapped, BatchDrafter)
    assert isinstance(wrapped.fork(), RowByRow) and wrapped.fork().drafter is not drafter


def test_settings_it_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="not a multiple of batch size"):
        check_sizes([1, 3], 4)
    with pytest.raises(ValueError, match="greedy only"):
        run_batches(batch_config("temperature=1.0"))
    typical = "rule.name=typical,rule.epsilon=0.1"
    cfg = batch_config(f'compare=["draft_model:chain1:num_layers=1,{typical}"]')
    with pytest.raises(ValueError, match="greedy only"):
        build_batch_methods(cfg, load_target_from_config(cfg.target))


def test_the_greedy_rule_as_a_mapping_is_greedy():
    cfg = batch_config('compare=["draft_model:chain1:num_layers=1,rule.name=greedy"]')
    assert "draft_model/chain1" in build_batch_methods(cfg, load_target_from_config(cfg.target))


def test_rows_end_at_their_first_eos():
    assert until_eos([5, 2, 7, 2], [2]) == [5, 2]
    assert until_eos([5, 6], [2]) == [5, 6]


def test_batches_wider_than_the_speculation_limit_decode_plainly():
    summary = run_batches(batch_config("batch_sizes=[1,4]", "max_batch_for_speculation=2"))
    drafted = {size: methods["draft_model/chain4"] for size, methods in summary["sizes"].items()}
    assert drafted[1]["tau"] > 1.0  # one row: drafts are verified and some accepted
    assert drafted[4]["identical"] == 1.0 and drafted[4]["tau"] < drafted[1]["tau"]
