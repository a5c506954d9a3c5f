"""make demo's last step: the trained draft beside the fastest exact method, and the line that
names the faster one."""

import json

from hydra import compose, initialize_config_dir

from experiments.common import CONF_DIR
from experiments.demo import (
    DRAFTER,
    HYBRID_LABEL,
    PLAIN,
    STEP,
    TREE_NAME,
    fastest_exact,
    fastest_line,
    prediction_line,
)
from experiments.methods import contenders


def test_the_fastest_exact_method_is_the_suffix_hybrid_with_the_trained_draft():
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("bench", [f"drafter={DRAFTER}", "drafter.checkpoint=/runs/eagle/ck",
                                fastest_exact("/runs/eagle/ck")])
    trained, hybrid = contenders(cfg)
    assert trained.name.startswith(f"{DRAFTER}/")
    assert hybrid.name == f"hybrid/adaptive ({HYBRID_LABEL})"
    members = hybrid.drafter.members
    assert [m.name for m in members] == ["suffix", "eagle"]
    assert members[1].checkpoint == "/runs/eagle/ck"  # the draft the demo trained


def _method(tokens_per_s: float, speedup: float, identical: float | None, draft_ms=None,
            verify_ms=None, tau=None) -> dict:
    return {"tokens_per_s": {"overall": tokens_per_s}, "speedup": {"overall": speedup},
            "identical": identical, "draft_ms_per_step": draft_ms,
            "verify_ms_per_step": verify_ms, "tau": tau}


def test_the_last_line_names_the_fastest_method_whose_output_matched():
    summary = {"baseline": "hf_greedy", "methods": {
        "hf_greedy": _method(18.0, 1.0, 1.0),
        PLAIN: _method(20.0, 1.11, 1.0, verify_ms=30.0),
        "eagle/eagle2": _method(24.0, 1.33, 1.0),
        "fast but wrong": _method(40.0, 2.2, 0.5),  # differed on a prompt: not exact
        "hybrid/adaptive (suffix+eagle)": _method(28.0, 1.56, 1.0)}}
    line = fastest_line(summary)
    # the speedup is over plain decoding on the same step, not over the baseline
    assert line == ("fastest exact method here: hybrid/adaptive (suffix+eagle), 1.40x plain "
                    "decoding on the same step (28.0 against 20.0 tokens/s)")
    summary["methods"] = {"hf_greedy": _method(20.0, 1.0, 1.0), PLAIN: _method(20.0, 1.0, 1.0),
                          "x": _method(30.0, 1.5, 0.9)}
    assert "none" in fastest_line(summary)


def test_where_no_tree_pays_the_last_line_says_so_and_why():
    summary = {"baseline": "hf_greedy", "methods": {
        "hf_greedy": _method(18.0, 1.0, 1.0), PLAIN: _method(20.0, 1.11, 1.0, verify_ms=30.0),
        "eagle/eagle2": _method(17.0, 0.94, 1.0, draft_ms=12.0, verify_ms=40.0, tau=1.6)}}
    line = fastest_line(summary)
    assert line.startswith("no tree pays on this machine: the fastest exact method, "
                           "eagle/eagle2, runs at 0.85x plain decoding")
    assert "12.0 ms drafting + 40.0 ms verifying for 1.60 tokens, a plain step 30.0 ms" in line


def test_the_tree_searchs_prediction_is_put_beside_what_the_benchmark_measured():
    chosen = {"predicted_tokens_per_s": 40.0, "tau": 1.5, "t_s": 0.030, "draft_s_per_step": 0.005,
              "loop_s_per_step": 0.0005}
    method = {**_method(30.0, 1.2, 1.0, draft_ms=6.0, verify_ms=32.0, tau=1.4),
              "other_ms_per_step": 3.0, "prefill_ms_per_step": 2.5, "new_tokens": 64,
              "seconds": 2.1}  # a bench method as the benchmark writes it
    line = prediction_line(chosen, {"methods": {f"{DRAFTER}/{TREE_NAME}": method}})
    # measured: 1.4 tokens in 6 + 32 + 0.5 ms (the prefill's 2.5 ms share left out)
    assert line.startswith(f"tree search: predicted 40.0 tokens/s for {DRAFTER}/{TREE_NAME}")
    assert "30.0 + 5.0 + 0.50 ms verify + draft + loop" in line
    assert "the benchmark measured 36.4 (tau 1.40, 32.0 + 6.0 + 0.50 ms)" in line
    assert line.endswith("0.91x the prediction")  # 36.4 / 40


def test_the_demo_benchmarks_on_the_openvino_step_against_plain_decoding_there():
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("bench", [f"drafter={DRAFTER}", *STEP, f"peers=[{PLAIN}]",
                                f"reference={PLAIN}"])
    assert cfg.target.step == "openvino" and list(cfg.peers) == [PLAIN]


def test_the_demo_regenerates_a_prefix_of_the_corpus_with_eagles_features_and_no_report():
    import experiments.schema  # noqa: F401  (registers the regeneration schema)
    from experiments.demo import CORPUS
    with initialize_config_dir(CONF_DIR, version_base=None):
        demo = compose("regenerate", CORPUS)
        corpus = compose("regenerate", ["experiment=regenerate/corpus"])
    assert demo.report is None and corpus.report is not None  # the committed account stays
    assert demo.regen.conversations < corpus.regen.conversations
    # everything else as the corpus's preset: the same folder key, so its prefix
    assert {**demo.regen, "conversations": 0} == {**corpus.regen, "conversations": 0}
    assert -1 in demo.regen.feature_layers  # what EAGLE-1 reads, captured while answering


def test_after_training_a_note_quotes_what_the_longer_preset_reached(tmp_path):
    from experiments.demo import longer_preset_note
    report = tmp_path / "onpolicy.json"
    assert longer_preset_note(0.4, report) is None  # no report: no note
    point = {"step": 6000, "train_cpu_seconds": 2700.0, "top1": [0.61, 0.5]}
    rows = [{"drafter": "EAGLE-3", "curve": [dict(point, top1=[0.7])]},
            {"drafter": "EAGLE-1", "max_steps": 8000,
             "curve": [dict(point, step=100, top1=[0.2]), point]}]
    report.write_text(json.dumps({"rows": rows}))
    note = longer_preset_note(0.391, report)
    assert "reaches held-out depth-1 top-1 0.391" in note
    assert "experiment=onpolicy drafter=eagle:" in note
    assert "6000 of 8000 steps, 45 CPU-minutes) reached 0.610" in note
    report.write_text(json.dumps({"rows": rows[:1]}))
    assert longer_preset_note(0.4, report) is None  # the demo's drafter not in it


def test_the_note_quotes_the_longer_presets_spec_bench_run_and_no_other(tmp_path):
    from experiments.demo import longer_preset_note
    curves, bench = tmp_path / "onpolicy.json", tmp_path / "onpolicy-spec-bench.json"
    point = {"step": 700, "train_cpu_seconds": 1440.0, "top1": [0.369]}
    curves.write_text(json.dumps({"rows": [{"drafter": "EAGLE-1", "max_steps": 1000,
                                            "curve": [point]}]}))
    method = {"tokens_per_s": {"overall": 30.0}, "speedup": {"overall": 0.9}, "new_tokens": 2945,
              "seconds": 94.2, "tau": 1.36,
              "acceptance_per_depth": [0.285, 0.2], "acceptance_stderr_per_depth": [0.02, 0.04]}

    def bench_run(checkpoint: str) -> str:
        config = {"drafter": {"name": "eagle", "checkpoint": checkpoint},
                  "tree": {"name": "chain4"}, "target": {"step": "openvino"}}
        return json.dumps({"config": config, "rows": [
            {"baseline": "plain_loop", "prompts": 26, "methods": {"eagle/chain4": method}}]})

    bench.write_text(bench_run("results/train/smollm2-135m-instruct/eagle/onpolicy/checkpoint"))
    note = longer_preset_note(0.4, curves, bench)
    assert note.endswith("reached 0.369, and on 26 Spec-Bench prompts (openvino step, chain4) "
                         "depth-1 acceptance 0.285 ± 0.020, tau 1.36 "
                         "(docs/results/learning-curves.md).")
    # a benchmark of another draft says nothing about the preset
    bench.write_text(bench_run("results/train/smollm2-135m-instruct/eagle/checkpoint"))
    assert "Spec-Bench" not in longer_preset_note(0.4, curves, bench)
