"""Benchmark figures on hand-made records, compare entries, and end-to-end runs on a tiny
target."""

import importlib
import json
import re

import pytest
import torch
from hydra import compose, initialize_config_dir

import experiments.methods
from drafters.draft_model import DraftModelConfig, save_draft_model
from drafters.medusa import MedusaDrafter, MedusaHeads
from experiments.bench import log_results
from experiments.bench_report import TABLE_COLUMNS, format_tables, plot_speedups, summarise
from experiments.common import CONF_DIR, write_report
from experiments.methods import (
    assistant_layers,
    build_methods,
    contenders,
    hf_assistant,
    own_weights_bytes,
    parse_compare,
    report_stem,
    run_benchmark,
)
from train.draft_model import initial_draft
from verify.runtime.model import load_target_from_config
from verify.tree import TreeTopology


def step(accepted, depth=3):
    return {"accepted": accepted, "tree_size": 4, "tree_depth": depth,
            "draft_s": 0.01, "verify_s": 0.1}


RECORDS = {
    "base": [{"category": "qa", "new_tokens": 10, "seconds": 1.0},
             {"category": "rag", "new_tokens": 10, "seconds": 2.0}],
    "tree": [{"category": "qa", "new_tokens": 10, "seconds": 0.5, "draft_forwards": 4,
              "steps": [step(0), step(2), step(3)]},
             {"category": "rag", "new_tokens": 10, "seconds": 2.0, "draft_forwards": 6,
              "steps": [step(1), step(3)]}],
}


def bench_config(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("bench", ["target=tiny_llama", "drafter.num_layers=1", "tree=tree8",
                                 "num_prompts=3", "max_new_tokens=12", *overrides])


def test_speedup_is_a_ratio_of_tokens_per_second_per_category():
    summary = summarise(RECORDS, "base")
    tree = summary["methods"]["tree"]
    assert tree["tokens_per_s"] == {"qa": 20.0, "rag": 5.0, "overall": 8.0}
    assert tree["speedup"]["qa"] == 2.0 and tree["speedup"]["rag"] == 1.0
    assert tree["speedup"]["overall"] == pytest.approx(8.0 / (20 / 3))


def test_tau_and_acceptance_per_depth_by_hand():
    tree = summarise(RECORDS, "base")["methods"]["tree"]
    # accepted 0, 2, 3, 1, 3 -> tokens per step 1, 3, 4, 2, 4
    assert tree["tau"] == pytest.approx(14 / 5)
    # depth 1: 4 of 5 steps; depth 2: 3 of the 4 that reached it; depth 3: 2 of 3
    assert tree["acceptance_per_depth"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert tree["target_forwards"] == 5
    assert tree["accepted_histogram"] == pytest.approx([0.2, 0.2, 0.2, 0.4])


def test_acceptance_standard_errors_over_prompts_by_hand():
    tree = summarise(RECORDS, "base")["methods"]["tree"]
    # depth 1: the qa prompt accepted it on 2 of 3 steps, the rag prompt on 2 of 2: mean 5/6,
    # sample sd 0.2357, over sqrt(2) prompts; depths 2 and 3: 1 and 1/2 (either order)
    assert tree["acceptance_stderr_per_depth"] == pytest.approx([1 / 6, 1 / 4, 1 / 4])
    assert "accept" in format_tables(summarise(RECORDS, "base"))
    assert "0.80 ± 0.17" in format_tables(summarise(RECORDS, "base"))


def test_time_per_step_by_hand():
    tree = summarise(RECORDS, "base")["methods"]["tree"]
    # 5 steps of 10 ms drafting and 100 ms verifying in 2.5 s of wall time; 10 draft forwards
    assert tree["draft_ms_per_step"] == pytest.approx(10.0)
    assert tree["verify_ms_per_step"] == pytest.approx(100.0)
    assert tree["other_ms_per_step"] == pytest.approx(500.0 - 110.0)
    assert tree["draft_forwards"] == 10 and tree["ms_per_draft_forward"] == pytest.approx(5.0)


def test_tables_and_plot(tmp_path):
    summary = summarise(RECORDS, "base")
    table = format_tables(summary)
    # the rest of a step: the loop's own 390 ms and no prefill recorded (0 s in RECORDS)
    assert ("| tree | 8.0 | 1.20x | 2.80 | 0.80 ± 0.17, 0.75, 0.67 | 10.0 | 100.0 | 390.0 + 0.0 "
            "| 5.0 |" in table)
    del summary["methods"]["tree"]["prefill_ms_per_step"]  # a report saved before prefill_s
    assert "| 10.0 | 100.0 | 390.0 | 5.0 |" in format_tables(summary)
    assert "| base | 6.7 | 1.00x | - | - | - | - | - | - |" in table
    assert "| qa | 1.00x | 2.00x |" in table
    path = plot_speedups(summary, tmp_path / "speedup.png")
    assert path.stat().st_size > 1000


def test_greedy_output_is_checked_against_the_reference_prompt_by_prompt():
    def rec(question, tokens, repeat=0):
        return {"category": "qa", "new_tokens": len(tokens), "seconds": 1.0,
                "question_id": question, "repeat": repeat, "tokens": tokens}

    records = {"base": [rec("a", [1, 2, 3]), rec("b", [4, 5]), rec("a", [1, 2, 3], 1)],
               # same tokens for a, a token changed for b, a cut short in run 1
               "tree": [rec("a", [1, 2, 3]), rec("b", [4, 6]), rec("a", [1, 2], 1)],
               "same": [rec("b", [4, 5]), rec("a", [1, 2, 3]), rec("a", [1, 2, 3], 1)]}
    summary = summarise(records, "base", reference="base")
    assert summary["methods"]["tree"]["identical"] == pytest.approx(1 / 3)
    assert summary["methods"]["same"]["identical"] == 1.0  # matched by prompt, not by order
    assert summary["methods"]["base"]["identical"] == 1.0
    table = format_tables(summary)
    assert "identical to the baseline |" in table and table.count("|---") == 11 + 4
    assert "| - | 33% |" in table
    assert "identical" not in summarise(records, "base")["methods"]["tree"]
    assert "identical" not in format_tables(summarise(records, "base"))


def test_plot_with_many_methods(tmp_path):
    records = {"base": RECORDS["base"], **{f"tree{i}": RECORDS["tree"] for i in range(12)}}
    path = plot_speedups(summarise(records, "base"), tmp_path / "speedup.png")
    assert path.stat().st_size > 1000


def test_a_compare_entry_loads_its_configs_with_overrides():
    contender = parse_compare("draft_model:chain4:num_layers=1,label=one layer")
    assert contender.name == "draft_model/chain4 (one layer)"
    assert contender.drafter.name == "draft_model" and contender.drafter.num_layers == 1
    assert contender.drafter.path is None  # the YAML's other keys stay
    assert contender.tree.name == "chain4" and len(contender.tree.choices) == 4
    # the overrides may hold colons; values are typed as YAML reads them
    contender = parse_compare("eagle3:eagle2:checkpoint=/runs/a:b,draft_vocab_size=null")
    assert contender.name == "eagle3/eagle2"
    assert contender.drafter.checkpoint == "/runs/a:b"
    assert contender.drafter.draft_vocab_size is None and contender.tree.total_tokens == 24
    # tree.<key> sizes a dynamic tree
    contender = parse_compare("eagle:eagle2:tree.total_tokens=8,tree.top_k=4,label=budget 8")
    assert contender.tree.total_tokens == 8 and contender.tree.top_k == 4
    assert contender.tree.depth == 5 and contender.name == "eagle/eagle2 (budget 8)"
    contender = parse_compare("medusa:tree8:rule=typical,label=typical")
    assert contender.rule == "typical" and contender.name == "medusa/tree8 (typical)"
    assert parse_compare("medusa:tree8").rule is None


def test_a_compare_entry_sets_the_acceptance_rules_settings():
    contender = parse_compare("medusa:tree8:rule.name=typical,rule.epsilon=0.05,label=typical")
    assert dict(contender.rule) == {"name": "typical", "epsilon": 0.05}
    with pytest.raises(ValueError, match=re.escape("'typical' has no setting(s) ['eps']")):
        parse_compare("medusa:tree8:rule.name=typical,rule.eps=0.05")


@pytest.mark.parametrize("entry, message", [
    ("eagle", "is not <drafter>:<tree>"),
    (":chain4", "is not <drafter>:<tree>"),
    ("eagel:chain4", "unknown drafter 'eagel'; known: ['dflash', 'draft_model', 'dspark', 'eagle'"),
    ("eagle:tree9", "unknown tree 'tree9'; known: ['adaptive', 'chain1'"),
    ("eagle:chain4:num_layers=1", "eagle cannot set ['num_layers']"),
    ("eagle:chain4:name=medusa", "eagle cannot set ['name']"),
    ("eagle:chain4:checkpoint", "['checkpoint'] not key=value"),
    ("eagle:eagle2:tree.total_token=8", "eagle2 cannot set ['tree.total_token']"),
    ("medusa:tree8:rule=typcal",
     "rule must be one of ['block', 'greedy', 'sampling', 'spectr', 'traversal', 'typical']"),
    ("eagle:chain4:tree.choices=[]", "chain4 cannot set ['tree.choices']"),
    ("medusa:tree8:rule.name=typical,rule.epsilon=-0.1", "rule.epsilon must be a number >= 0"),
])
def test_a_bad_compare_entry_is_refused_clearly(entry, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_compare(entry)


@pytest.mark.parametrize("entry", ["recycling:recycling:rule=block",
                                   "prompt_lookup:tree8:rule=block",
                                   "eagle:eagle2:rule=block",
                                   "hybrid:suffix:rule=block"])
def test_the_block_rule_is_refused_before_decoding_for_a_drafter_whose_trees_branch(entry):
    with pytest.raises(ValueError, match=re.escape(f"compare entry {entry!r}: the 'block' rule "
                                                   "verifies chains only")):
        parse_compare(entry)
    # on a chain it stays: what correctness's block row runs on as well
    assert parse_compare("prompt_lookup:chain4:rule=block").rule == "block"


@pytest.mark.parametrize("entry, why", [
    ("prompt_lookup:chain4:rule=traversal", "chooses its children (no draft probabilities)"),
    ("suffix:suffix:rule=spectr", "chooses its children"),
    ("eagle:eagle2:rule=traversal", "chooses its children"),  # EAGLE-2: top-k by score
    ("dflash:ddtree8:rule=traversal", "chooses its children"),
    ("hybrid:suffix:rule=traversal", "chooses its children"),
    ("draft_model:tree8:rule=spectr", "draws them without replacement: set "
                                      "drafter.iid_siblings=true"),
    ("medusa:tree8:rule=spectr", "draws them without replacement")])
def test_a_sequence_rule_is_refused_before_decoding_for_trees_it_cannot_verify(entry, why):
    with pytest.raises(ValueError, match=re.escape(f"compare entry {entry!r}: the "
                                                   f"'{entry.rsplit('=', 1)[1]}' rule ")
                       + ".*" + re.escape(why)):
        parse_compare(entry)


@pytest.mark.parametrize("entry", ["draft_model:tree8:rule=traversal",
                                   "medusa:chain4:rule=traversal",
                                   "eagle3:tree8:rule=traversal", "dflash:chain4:rule=traversal",
                                   "draft_model:tree8:iid_siblings=true,rule=spectr",
                                   "draft_model:chain4:iid_siblings=true,rule=spectr"])
def test_a_sequence_rule_stays_for_a_drafter_that_draws_what_it_needs(entry):
    assert parse_compare(entry).rule == entry.rsplit("=", 1)[1]


@pytest.mark.parametrize("entry, rule", [
    ("draft_model:tree8:rule=traversal", "traversal"),
    ("draft_model:tree8:iid_siblings=true,rule=spectr", "spectr")])
def test_a_rule_for_sampled_drafts_at_temperature_0_is_refused_before_anything_loads(
        entry, rule, monkeypatch):
    """rule=traversal at temperature 0 was refused only once the target had loaded and the
    drafter was built; the greedy rule above temperature 0 likewise."""
    monkeypatch.setattr(experiments.methods, "load_target_from_config", no_target)
    for temperature, refusal in ((0, f"the {rule!r} rule verifies sampled drafts, but "
                                     "decoding is greedy"),
                                 (1, "the greedy rule needs temperature 0")):
        asked = entry if temperature == 0 else "draft_model:chain4:rule=greedy"
        cfg = bench_config(f"temperature={temperature}", f"compare=['{asked}']")
        with pytest.raises(ValueError, match=re.escape(f"compare entry {asked!r}: {refusal}")):
            run_benchmark(cfg)
    assert [c.rule for c in contenders(bench_config("temperature=1",
                                                    f"compare=['{entry}']"))] == [None, rule]


def no_target(*args, **kwargs):
    raise AssertionError("the target loaded before the settings were checked")


def test_method_names_stay_distinct_and_the_main_drafter_comes_first():
    cfg = bench_config("compare=[draft_model:chain4,draft_model:chain4,draft_model:tree8,"
                       "'draft_model:chain4:label=b']")
    assert [c.name for c in contenders(cfg)] == [
        "draft_model/tree8", "draft_model/chain4", "draft_model/chain4 #2",
        "draft_model/tree8 #2", "draft_model/chain4 (b)"]
    assert report_stem(cfg) == ("tiny-llama-draft_model-tree8+draft_model-chain4+"
                                "draft_model-chain4-2+draft_model-tree8-2+draft_model-chain4-b")


def test_a_report_is_named_by_the_target_loaded_and_a_batch_bench_apart():
    """target.path=B keeps conf's target name (here tiny-llama's): the report says B; a
    batch_bench of the same methods does not share the bench's file."""
    cfg = bench_config("target=smollm2", "target.path=/models/B", "compare=[]")
    assert cfg.target.name == "smollm2-135m-instruct"
    assert report_stem(cfg) == "models-B-draft_model-tree8"
    assert report_stem(cfg, "batch") == "models-B-draft_model-tree8-batch"


def test_every_setting_that_changes_the_figures_names_the_report_apart():
    """The bench at temperature 0, then 1, then on the OpenVINO step, in bfloat16, or with
    an entry's rule changed, into one out_dir: one report each. A default is left unsaid,
    so the reports made at the defaults keep their names."""
    runs = [[], ["temperature=1"], ["target.step=openvino"], ["target.dtype=bfloat16"],
            ["compare=[draft_model:chain4]"], ["compare=['draft_model:chain4:rule=block']"],
            ["temperature=1", "compare=['draft_model:chain4:rule=traversal']"]]
    stems = [report_stem(bench_config(*run)) for run in runs]
    assert len(set(stems)) == len(stems)
    assert stems[:4] == ["tiny-llama-draft_model-tree8", "tiny-llama-draft_model-tree8-t1",
                         "tiny-llama-draft_model-tree8-openvino",
                         "tiny-llama-draft_model-tree8-bfloat16"]
    assert stems[5] == "tiny-llama-draft_model-tree8+draft_model-chain4-block"


def test_a_long_comparison_gets_a_short_distinct_file_name(tmp_path):
    entries = [f"'draft_model:chain4:label=a rather long label number {i}'" for i in range(8)]
    stems = {report_stem(bench_config(f"compare=[{','.join(entries[:n])}]"))
             for n in (7, 8)}
    assert len(stems) == 2 and all(len(stem) <= 120 for stem in stems)
    for stem in stems:  # the file system takes it, with the suffixes the reports add
        (tmp_path / f"{stem}.json.tmp").write_text("{}")


def test_drafters_compared_on_a_tiny_target(tmp_path):
    cfg = bench_config("num_prompts=2", "max_new_tokens=8", "peers=[plain_loop]",
                       "compare=['draft_model:chain4:num_layers=1',eagle:eagle2]")
    summary = run_benchmark(cfg)
    path = write_report(tmp_path, report_stem(cfg), [summary], cfg)  # as main() does
    methods = json.loads(path.read_text())["rows"][0]["methods"]
    assert list(methods) == ["hf_greedy", "plain_loop", "draft_model/tree8",
                             "draft_model/chain4", "eagle/eagle2"]
    for name in ["draft_model/tree8", "draft_model/chain4", "eagle/eagle2"]:
        m = methods[name]
        assert m["draft_forwards"] >= m["target_forwards"]  # a catch-up forward at least
        assert m["ms_per_draft_forward"] > 0
        per_step = m["draft_ms_per_step"] + m["verify_ms_per_step"] + m["other_ms_per_step"]
        assert per_step == pytest.approx(1000 * m["seconds"] / m["target_forwards"])
        # the prefill is timed inside the method's wall time, outside its steps
        assert 0 < m["prefill_ms_per_step"] <= m["other_ms_per_step"]
    assert "ms_per_draft_forward" not in methods["plain_loop"]
    assert "| plain_loop |" in format_tables(summary)
    # greedy: every method wrote Hugging Face greedy's tokens on every prompt
    assert all(m["identical"] == 1.0 for m in methods.values())


def test_the_assisted_peer_fits_the_target_or_names_its_key():
    class Layers:
        def __init__(self, n):
            self.num_hidden_layers = n

    assert assistant_layers(None, Layers(30)) == 6 and assistant_layers(None, Layers(2)) == 1
    assert assistant_layers(3, Layers(30)) == 3
    with pytest.raises(ValueError, match=r"hf_assistant_num_layers=6 does not fit a target of "
                                         r"2 layers.*drop hf_assisted from peers"):
        assistant_layers(6, Layers(2))
    assert bench_config().hf_assistant_num_layers is None  # the default fits any target


def test_end_to_end_on_a_tiny_target():
    cfg = bench_config("hf_assistant_num_layers=1")
    summary = run_benchmark(cfg)
    methods = summary["methods"]
    assert list(methods) == ["hf_greedy", "plain_loop", "draft_model/tree8",
                             "hf_prompt_lookup", "hf_assisted"]
    assert summary["prompts"] == 3
    for m in methods.values():
        assert m["new_tokens"] == 3 * 12 and m["tokens_per_s"]["overall"] > 0
    assert methods["plain_loop"]["tau"] == 1.0
    assert methods["draft_model/tree8"]["tau"] >= 1.0
    assert len(methods["draft_model/tree8"]["acceptance_per_depth"]) == 4


def test_repeats_give_each_speedup_a_median_and_range():
    # run 0: tree twice as fast as base; run 1: as fast; run 2: four times
    seconds = {0: 0.5, 1: 1.0, 2: 0.25}
    records = {
        "base": [{"category": "qa", "new_tokens": 10, "seconds": 1.0, "repeat": r}
                 for r in seconds],
        "tree": [{"category": "qa", "new_tokens": 10, "seconds": s, "repeat": r}
                 for r, s in seconds.items()],
    }
    summary = summarise(records, "base")
    tree = summary["methods"]["tree"]
    assert summary["repeats"] == 3 and summary["prompts"] == 1
    assert tree["speedup_runs"] == pytest.approx([2.0, 1.0, 4.0])
    assert tree["speedup_median"] == pytest.approx(2.0)
    assert tree["speedup_range"] == pytest.approx([1.0, 4.0])
    assert tree["speedup"]["overall"] == pytest.approx(30 / 1.75 / 10)  # pooled
    assert "speedup_runs" not in summary["methods"]["base"]
    assert "| tree | 17.1 | 1.71x (2.00x [1.00, 4.00]) |" in format_tables(summary)
    assert "median [min, max]" in format_tables(summary)


def test_a_sampled_benchmark_on_a_tiny_target(tmp_path):
    cfg = bench_config("num_prompts=2", "max_new_tokens=8", "temperature=1.0", "top_p=0.9",
                       "repeats=2", "peers=[plain_loop,hf_prompt_lookup]",
                       "compare=[eagle:eagle2,prompt_lookup:tree8,"
                       "'draft_model:tree8:num_layers=1,rule=typical,label=typical']")
    summary = run_benchmark(cfg)
    path = write_report(tmp_path, report_stem(cfg), [summary], cfg)
    report = json.loads(path.read_text())
    methods = report["rows"][0]["methods"]
    assert list(methods) == ["hf_sample", "plain_loop", "draft_model/tree8", "eagle/eagle2",
                             "prompt_lookup/tree8", "draft_model/tree8 (typical)",
                             "hf_prompt_lookup"]
    assert summary["repeats"] == 2 and summary["prompts"] == 2
    for name, m in methods.items():
        assert m["tokens_per_s"]["overall"] > 0
        if name != "hf_sample":
            assert len(m["speedup_runs"]) == 2
    # the draft's own memory: an EAGLE layer and cache; prompt lookup has neither
    assert methods["eagle/eagle2"]["draft_weights_mb"] > 0.01
    assert methods["eagle/eagle2"]["draft_cache_mb"] > 0
    assert methods["prompt_lookup/tree8"]["draft_weights_mb"] == 0
    assert "draft_weights_mb" not in methods["plain_loop"]
    assert not any("identical" in m for m in methods.values())  # sampled: no token check
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["cpu_count"] >= 1
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", env["git_commit"])


def test_own_weights_count_what_the_drafter_adds_to_the_target():
    target = load_target_from_config(bench_config().target)
    heads = MedusaHeads(target.model.get_output_embeddings(), 2, 1, share_lm_head=True)
    drafter = MedusaDrafter(heads, TreeTopology.from_choices([[0], [0, 0]]))
    added = sum(p.numel() * 4 for p in heads.blocks.parameters())
    assert own_weights_bytes(drafter, target.model) == added


def test_zero_repeats_are_refused_before_the_target_loads():
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        run_benchmark(bench_config("repeats=0", "target.path=/nowhere"))


def test_hf_assisted_runs_a_saved_full_vocabulary_draft_and_refuses_a_reduced_one(tmp_path):
    target = load_target_from_config(bench_config().target)
    student = initial_draft(target.model, DraftModelConfig(num_layers=1), None)
    save_draft_model(student, None, tmp_path / "full", target, {})
    cfg = bench_config(f"hf_assistant_path={tmp_path / 'full'}")
    assistant = hf_assistant(cfg, target)
    assert assistant.config.num_hidden_layers == 1
    assert torch.equal(assistant.get_output_embeddings().weight,
                       student.get_output_embeddings().weight)
    vocab = torch.arange(0, 256, 2)
    reduced = initial_draft(target.model, DraftModelConfig(num_layers=1), vocab)
    save_draft_model(reduced, vocab, tmp_path / "reduced", target, {})
    with pytest.raises(ValueError, match="reduced vocabulary.*draft_vocab_size=null"):
        hf_assistant(bench_config(f"hf_assistant_path={tmp_path / 'reduced'}"), target)


class RecordingLogger:
    location = "recorded"

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):  # table, summary, image, finish: record the call
        return lambda *args: self.calls.append((name, args))


def test_results_are_logged_as_a_table_figures_and_the_plot(tmp_path, monkeypatch):
    summary = summarise(RECORDS, "base")
    plot = plot_speedups(summary, tmp_path / "p.png")
    logger = RecordingLogger()
    monkeypatch.setattr("experiments.bench.build_logger", lambda *args: logger)
    cfg = bench_config(f"out_dir={tmp_path}")
    assert log_results(cfg, summary, plot, "s") == "logged: recorded"
    calls = dict(logger.calls)
    name, columns, rows = calls["table"]
    assert name == "methods" and columns == TABLE_COLUMNS
    assert rows[1][:5] == ["tree", 8.0, pytest.approx(1.2), pytest.approx(14 / 5), 0.8]
    assert rows[0][3] is None  # the baseline has no tau
    figures = calls["summary"][0]
    assert figures["tree/speedup"] == pytest.approx(1.2) and "base/tau" not in figures
    assert calls["image"] == ("speedup_per_category", plot) and "finish" in calls


def test_an_offline_wandb_run_holds_the_benchmark(tmp_path):
    summary = summarise(RECORDS, "base")
    cfg = bench_config(f"out_dir={tmp_path}", "logger.mode=offline")
    assert "W&B run" in log_results(cfg, summary, None, "tiny-run")
    assert list((tmp_path / "tiny-run" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_the_batch_invariant_mode_applies_to_our_loop_only(monkeypatch):
    cfg = bench_config("peers=[plain_loop]", "pad_rows=8", "loop_attention=row_invariant")
    target = load_target_from_config(cfg.target)
    seen = []
    real = target.model.forward

    def spy(*args, **kwargs):  # which attention and how many rows each forward ran
        seen.append((target.model.config._attn_implementation, kwargs["input_ids"].shape[1]))
        return real(*args, **kwargs)
    monkeypatch.setattr(target.model, "forward", spy)
    methods = build_methods(cfg, target, contenders(cfg))
    prompt = torch.arange(5, 17)
    methods["plain_loop"](prompt, 6, 0)
    assert {attn for attn, _ in seen} == {"row_invariant"} and seen[-1][1] == 8
    seen.clear()
    methods["hf_greedy"](prompt, 6, 0)
    assert {attn for attn, _ in seen} == {"sdpa"}  # the target's own, restored


def suffix_bench_config(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("bench", ["target=tiny_llama", "drafter=suffix", "tree=suffix",
                                 "num_prompts=2", "max_new_tokens=24", "peers=[]",
                                 "logger=none", *overrides])


def test_a_repeated_prompt_never_drafts_from_its_own_earlier_answer():
    from experiments.methods import Prompt, time_methods

    cfg = suffix_bench_config("repeats=3", "warmup=1")
    target = load_target_from_config(cfg.target)
    method = build_methods(cfg, target, contenders(cfg))["suffix/suffix"]
    prompt = Prompt("qa", "q1", torch.tensor([40, 41, 42, 43, 40, 41, 42, 44]))
    clean = time_methods({"suffix": method}, [prompt], cfg)["suffix"]
    accepted = [[s["accepted"] for s in r["steps"]] for r in clean]
    assert accepted[0] == accepted[1] == accepted[2]  # memory emptied before every repeat
    # the control: the same drafter with its memory kept copies its earlier answer
    leaky = {"suffix": lambda ids, n, seed: method(ids, n, seed)}  # no `forget`
    copied = time_methods(leaky, [prompt], cfg)["suffix"]
    assert len(copied[1]["steps"]) < len(clean[1]["steps"]) / 2


def test_the_report_says_how_a_memory_was_warmed():
    summary = run_benchmark(suffix_bench_config())
    assert "with their warm start only, empty without one" in summary["memory"]
    assert "Memory: drafters with memory" in format_tables(summary)
    assert summary["methods"]["suffix/suffix"]["identical"] == 1.0
    assert "memory" not in run_benchmark(bench_config("num_prompts=1", "max_new_tokens=4",
                                                      "peers=[]"))


def test_tree_sizes_and_proposers_are_reported():
    records = {"base": [{"category": "qa", "new_tokens": 4, "seconds": 1.0}],
               "hybrid": [{"category": "qa", "new_tokens": 4, "seconds": 0.5,
                           "proposed_by": {"suffix": 1, "eagle": 3},
                           "steps": [step(1, 2), step(0, 1), step(2, 3), step(0, 1)]}]}
    for s, size in zip(records["hybrid"][0]["steps"], [3, 2, 5, 2]):
        s["tree_size"] = size
    hybrid = summarise(records, "base")["methods"]["hybrid"]
    assert hybrid["proposed_by"] == {"suffix": 0.25, "eagle": 0.75}
    assert hybrid["tree_size_histogram"] == {2: 0.5, 3: 0.25, 5: 0.25}
    assert hybrid["mean_tree_size"] == 3.0
    assert "| hybrid | 3.00 | 2: 50%, 3: 25%, 5: 25% | suffix 25%, eagle 75% |" in \
        format_tables(summarise(records, "base"))


def test_a_compare_entry_sets_a_hybrid_members_key_by_its_index():
    contender = parse_compare("hybrid:suffix:policy=merge,members.1.checkpoint=/runs/a:b,"
                              "label=merged")
    assert contender.name == "hybrid/suffix (merged)" and contender.drafter.policy == "merge"
    assert contender.drafter.members[1].checkpoint == "/runs/a:b"
    assert contender.drafter.members[1].tree.total_tokens == 2  # the rest of it kept
    with pytest.raises(ValueError, match=r"hybrid cannot set \['member'\]"):
        parse_compare("hybrid:suffix:member.1.checkpoint=/x")


def test_the_tables_are_generated_from_the_saved_json(tmp_path):
    from experiments.bench_report import write_tables

    summary = summarise(RECORDS, "base")
    path = write_report(tmp_path, "run", [summary], bench_config())
    tables = write_tables(path).read_text()
    assert tables.startswith("<!-- generated by python -m experiments.bench_report run.json")
    assert format_tables(summary) in tables
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"n": 1}]}))
    with pytest.raises(ValueError, match="holds no experiments.bench summary"):
        write_tables(tmp_path / "other.json")
    sizes = {"baseline": "hf_greedy", "reference": "plain_loop at B = 1",
             "sizes": {"1": {"hf_greedy": {"tokens_per_s": 10.0, "speedup": 1.0,
                                           "identical": 1.0, "new_tokens": 8,
                                           "seconds": 0.8}}}}
    (tmp_path / "batch.json").write_text(json.dumps({"rows": [sizes]}))
    assert "| 1 | hf_greedy | 10.0 | 1.00x |" in write_tables(tmp_path / "batch.json").read_text()


def test_a_method_reads_draft_work_and_proposers_through_the_declared_abilities():
    from collections import Counter

    from experiments.methods import treedraft_method
    from tests.drafters.toy_drafter import RepeatDrafter
    from verify.protocol import DraftStats, ProposalCounts, Resettable
    from verify.runtime.model import load_target
    from verify.sampling import SamplingParams

    class Counted(RepeatDrafter, DraftStats, ProposalCounts):
        """Counts a 'draft forward' and a proposal per step, with no DraftEngine behind it."""

        def __init__(self):
            super().__init__(2)
            self.forwards, self.proposed = 5, Counter()  # counts from earlier runs

        @property
        def draft_forwards(self):
            return self.forwards

        def propose(self, ctx):
            self.forwards += 1
            self.proposed["me"] += 1
            return super().propose(ctx)

        def draft_cache_bytes(self):
            return 2**20

    target = load_target(tiny="llama")
    method = treedraft_method(target, Counted(), SamplingParams(0.0))
    record = method(torch.tensor([40, 41, 42, 40, 41]), 6, 0)
    steps = len(record["steps"])
    assert record["draft_forwards"] == steps and record["draft_cache_mb"] == 1.0
    assert record["proposed_by"] == {"me": steps}
    assert not isinstance(method, Resettable)  # no memory: nothing for time_methods to empty
    plain = treedraft_method(target, RepeatDrafter(2), SamplingParams(0.0))
    assert {"draft_forwards", "proposed_by"}.isdisjoint(plain(torch.tensor([40, 41]), 4, 0))


def test_identity_is_counted_against_the_reference_method_when_one_is_named():
    def outputs(records, tokens):
        return [dict(r, question_id=str(i), tokens=tokens(i)) for i, r in enumerate(records)]

    with_tokens = {"base": outputs(RECORDS["base"], lambda i: [1, 2]),
                   "plain": outputs(RECORDS["base"], lambda i: [1, 3]),
                   "tree": outputs(RECORDS["tree"], lambda i: [1, 3 if i == 0 else 4])}
    against_plain = summarise(with_tokens, "base", reference="plain")
    assert against_plain["reference"] == "plain"
    assert against_plain["methods"]["tree"]["identical"] == 0.5
    assert against_plain["methods"]["base"]["identical"] == 0.0
    assert summarise(with_tokens, "base", reference="base").get("reference") is None
    assert "| identical to plain |" in format_tables(against_plain)
    assert "identical to the baseline" in format_tables(summarise(with_tokens, "base", "base"))


@pytest.mark.parametrize("overrides", [["reference=hf_greedy"],
                                       ["reference=plain_loop", "peers=[]"]])
def test_a_reference_that_is_not_plain_decoding_in_this_run_is_refused(overrides):
    with pytest.raises(ValueError, match="reference must be null"):
        run_benchmark(bench_config(*overrides, "target.path=/nowhere"))


@pytest.mark.parametrize("command", ["bench", "batch_bench", "context_sweep"])
@pytest.mark.parametrize("setting", ["max_new_tokens=0", "repeats=0", "reference=hf_sample"])
def test_settings_a_bench_cannot_mean_are_refused_before_its_out_dir_is_made(
        command, setting, tmp_path, monkeypatch):
    """max_new_tokens=0 was refused by transformers inside the timed baseline, leaving an
    empty out_dir behind."""
    module = importlib.import_module(f"experiments.{command}")
    for loader in (module, experiments.methods):
        monkeypatch.setattr(loader, "load_target_from_config", no_target, raising=False)
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(command, ["target=tiny_llama", setting, f"out_dir={tmp_path / 'out'}"])
    key, value = setting.split("=")
    with pytest.raises(ValueError, match=rf"{key}.*{value}"):
        module.main.__wrapped__(cfg)
    assert not (tmp_path / "out").exists()
