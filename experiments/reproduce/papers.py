"""The papers this framework reproduces: their claims, published figures, and how each claim is
checked against our saved JSON (experiments/reports/).

Published figures are the papers' own (abstracts, and Spec-Bench's leaderboard file); ours are
read from JSON that the named commands wrote. Paths in commands: <draft> is a distilled draft
model (python train.py drafter=draft_model), <eagle 1M> EAGLE-1 trained on 1M ShareGPT tokens,
<medusa> the default Medusa-1 run; each one's checkpoint folder.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.reproduce.report import (
    HELD,
    NOT_HELD,
    PARTLY,
    Claim,
    Finding,
    MissingReport,
    Paper,
    Table,
    bench_methods,
    method,
    read_report,
)
from experiments.stats import leviathan_expected_tokens

SETUP = ("SmolLM2-135M-Instruct in float32 on this kind of machine (2 CPU cores, no GPU), "
         "greedy, 128 new tokens, Spec-Bench prompts spread round-robin over its 13 "
         "categories; speedup is tokens/s over Hugging Face greedy `generate` of the same "
         "target in the same run; tau is tokens per target forward. The papers ran 7B-70B "
         "targets on GPUs, where verifying tens of tokens costs about what one does; here a "
         "verification of n tokens costs t(n) > t(1) (README, \"What a verification step "
         "costs here\"), so small trees win.")

# One benchmark run behind most claims below (experiments/reports/reproduce/).
REPRODUCE_BENCH = "reproduce/smollm2-135m-instruct-draft_model-chain1+*.json"
REPRODUCE_COMMAND = """\
python -m experiments.bench experiment=bench/reproduce checkpoints.draft=<draft> \\
    checkpoints.eagle=<eagle 1M> checkpoints.medusa=<medusa>
# = drafter=draft_model tree=chain1, compare: draft_model on chain2/3/4/6, eagle on tree8 and
#   on an 8-node eagle2 tree, medusa on chain4 and medusa_sparse4 (conf/experiment/bench/)"""
FLOAT32_BENCH = "eagle-float32/*.json"
FLOAT32_COMMAND = """\
python -m experiments.bench drafter=eagle drafter.checkpoint=<eagle 1M> tree=eagle2_auto \\
    num_prompts=13 max_new_tokens=128 peers=[plain_loop,hf_prompt_lookup] \\
    'compare=["eagle:eagle2_auto:checkpoint=<eagle 200k>,label=200k",
              "eagle3:eagle2_auto:checkpoint=<eagle3 200k>",
              "medusa:medusa_auto:checkpoint=<medusa>,label=self-distilled",
              "medusa:medusa_auto:checkpoint=<medusa ShareGPT>,label=ShareGPT",
              "prompt_lookup:tree8"]'
# then: mkdir -p experiments/reports/eagle-float32 and move the JSON there"""
CHAINS = [1, 2, 3, 4, 6]
# Held-out tau from a training run's evaluation (8 prompts x 64 tokens, ~300 steps) has a
# standard error of ~0.04 (tokens per step spread ~0.7); a gap below this is no difference.
TAU_NOISE = 0.05


def _reproduce_bench(reports: Path) -> dict[str, dict]:
    return bench_methods(read_report(reports, REPRODUCE_BENCH, "run the command above"))


def _speedup(figures: dict) -> float:
    return figures["speedup"]["overall"]


# --- Leviathan et al. -------------------------------------------------------------------------

def _controlled_chain(reports: Path) -> Finding:
    found = {}  # every correctness report runs the same check: one row per (alpha, gamma)
    for path in sorted((reports / "correctness").glob("*.json")):
        for row in read_report(path.parent, path.name, "")["rows"]:
            if row.get("drafter") == "controlled chain":
                found[row["detail"]["alpha"], row["detail"]["gamma"]] = row
    rows = list(found.values())
    if not rows:
        raise MissingReport("no correctness report with the controlled-chain rows; run "
                            "python -m experiments.correctness")
    table = Table(["alpha", "gamma", "formula", "measured tokens/step", "stderr", "within 3 sigma"],
                  [[r["detail"]["alpha"], r["detail"]["gamma"], r["detail"]["expected"], r["value"],
                    r["detail"]["stderr"], r["passed"]] for r in rows])
    held = all(r["passed"] for r in rows)
    return Finding(table, HELD if held else NOT_HELD,
                   f"{sum(r['passed'] for r in rows)} of {len(rows)} measured means lie within "
                   "3 standard errors of the closed form.")


def _real_chain(reports: Path) -> Finding:
    methods = _reproduce_bench(reports)
    alpha = method(methods, "draft_model/chain1")["acceptance_per_depth"][0]
    rows, errors = [], []
    for gamma in CHAINS:
        figures = method(methods, f"draft_model/chain{gamma}")
        formula = leviathan_expected_tokens(alpha, gamma)
        errors.append(figures["tau"] / formula - 1)
        rows.append([gamma, formula, figures["tau"],
                     ", ".join(f"{a:.2f}" for a in figures["acceptance_per_depth"]),
                     f"{100 * errors[-1]:+.0f}%"])
    worst = max(errors, key=abs)
    return Finding(Table(["gamma", "formula, alpha = chain1's rate", "measured tau",
                          "acceptance by depth", "measured vs formula"], rows),
                   HELD if abs(worst) <= 0.1 else NOT_HELD,
                   f"alpha = {alpha:.3f} (depth-1 acceptance with gamma = 1); the largest "
                   f"deviation of measured tau from the formula is {100 * worst:+.0f}%.")


def _speed_by_gamma(reports: Path) -> Finding:
    methods = _reproduce_bench(reports)
    simulated = read_report(reports, "reproduce/leviathan-simulate.json",
                            "run the simulate command above")["rows"]
    predicted = {r["gamma"]: r for r in simulated if "method" in r}
    rows = []
    for gamma in CHAINS:
        figures = method(methods, f"draft_model/chain{gamma}")
        row = predicted.get(gamma)
        rows.append([gamma, figures["tau"], figures["draft_ms_per_step"],
                     figures["verify_ms_per_step"],
                     f"{row['predicted_speedup']:.2f}x" if row else "-",
                     f"{_speedup(figures):.2f}x"])
    best = max(CHAINS, key=lambda g: _speedup(methods[f"draft_model/chain{g}"]))
    optimum = simulated[0]["optimal_gamma"]
    best_speed = _speedup(methods[f"draft_model/chain{best}"])
    verdict = HELD if best == optimum else NOT_HELD
    if best_speed < 1:
        verdict = NOT_HELD
    return Finding(Table(["gamma", "tau", "draft ms/step", "verify ms/step",
                          "predicted speedup", "measured speedup"], rows), verdict,
                   f"The formula with measured costs picks gamma = {optimum}; the fastest "
                   f"measured chain is gamma = {best} at {best_speed:.2f}x.")


LEVIATHAN = Paper(
    key="leviathan",
    title="Leviathan et al. 2023, Fast Inference from Transformers via Speculative Decoding",
    source="arXiv:2211.17192 (ICML 2023), abstract and section 3.",
    published=Table(["model", "hardware", "claim"],
                    [["T5-XXL (11B) with a small T5 draft", "TPU-v4",
                      "2X-3X faster than the standard T5X implementation, identical outputs"]]),
    setup=SETUP + " The draft is a 2-layer model distilled from the target (`train.py "
                  "drafter=draft_model`), drafting chains of gamma tokens.",
    claims=(
        Claim("Tokens per step follow (1 - alpha^(gamma+1)) / (1 - alpha)",
              "With each draft token accepted independently with probability alpha, a step "
              "yields that many tokens on average (eq. 1).",
              "python -m experiments.correctness   # its `chain` rows: a drafter right with "
              "probability alpha, on the tiny target",
              _controlled_chain,
              "This checks the loop's bookkeeping against the formula where its assumption "
              "holds by construction."),
        Claim("The formula predicts a trained draft's tau",
              "alpha is the expected acceptance rate, E[beta]; the analysis assumes the "
              "betas are i.i.d. (section 3.1).",
              REPRODUCE_COMMAND, _real_chain,
              "Acceptance of a real draft is not independent across depths: a draft right "
              "twice in a row is in easy text, and the rates at depth 3 and beyond run above "
              "depth 1's. At this draft's acceptance few steps get that deep, so those rates "
              "carry little weight and the i.i.d. formula holds; a better draft would expose "
              "the dependence."),
        Claim("Speedup against gamma, and the optimal gamma for the cost ratio",
              "Speedup = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); the optimal "
              "gamma follows from alpha and c (section 3.5, figure 3).",
              REPRODUCE_COMMAND + "\n# t(n): any accuracy table will do, only the timing "
              "is read\npython -m experiments.tree_search "
              "accuracies=<medusa run>/eval.json 'sizes=[1,2,3,4,5,6,7]' repeats=10 "
              "name=cost_by_n out=/tmp/cost_by_n.yaml out_dir=experiments/reports/reproduce\n"
              "python -m experiments.simulate "
              "costs=experiments/reports/reproduce/smollm2-135m-instruct-cost_by_n.json "
              "bench=experiments/reports/reproduce/<the bench JSON> "
              "alpha_from=draft_model/chain1 name=leviathan-simulate "
              "out_dir=experiments/reports/reproduce",
              _speed_by_gamma,
              "On a GPU t(n) is nearly flat in n, so c alone sets gamma; on this CPU t(n) "
              "jumps past three tokens, and the simulator takes the measured t(n) instead of a "
              "constant. Two things it leaves out pull in opposite directions: the loop's own "
              "work each step (it over-predicts short chains) and the cheaper later forwards "
              "of a chain, charged at the one-token chain's cost (it under-predicts long "
              "ones). Plot: experiments/reports/reproduce/leviathan-simulate.png."),
    ),
)


# --- Medusa -----------------------------------------------------------------------------------

def _family_speed(reports: Path, prefixes: tuple[str, ...], family: str,
                  sentence: str) -> Finding:
    """Tau and speedup of the float32 side-by-side run's methods starting with `prefixes`;
    `sentence` ("... {best:.2f}x ...") states the best speedup against the paper's."""
    methods = bench_methods(read_report(reports, FLOAT32_BENCH, "run the command above"))
    names = [n for n in methods if n.startswith(prefixes)]
    if not names:
        raise MissingReport(f"the float32 side-by-side run has no {family} method")
    rows = [[n, methods[n]["tau"], f"{_speedup(methods[n]):.2f}x"] for n in names]
    best = max(_speedup(methods[n]) for n in names)
    return Finding(Table(["method", "tau", "speedup"], rows), PARTLY if best > 1 else NOT_HELD,
                   sentence.format(best=best))


def _medusa_speed(reports: Path) -> Finding:
    return _family_speed(reports, ("medusa/",), "medusa",
                         "Medusa-1 heads run at {best:.2f}x of plain decoding here, against "
                         "2.2x and more on Vicuna-7B in the paper.")


def _sparse_vs_chain(reports: Path) -> Finding:
    methods = _reproduce_bench(reports)
    chain, sparse = method(methods, "medusa/chain4"), method(methods, "medusa/medusa_sparse4")
    rows = [["chain, 4 nodes", chain["tau"], chain["verify_ms_per_step"],
             f"{_speedup(chain):.2f}x"],
            ["sparse tree, 4 nodes ([0],[1],[2],[0,0])", sparse["tau"],
             sparse["verify_ms_per_step"], f"{_speedup(sparse):.2f}x"]]
    held = sparse["tau"] > chain["tau"] and _speedup(sparse) > _speedup(chain)
    return Finding(Table(["tree", "tau", "verify ms/step", "speedup"], rows),
                   HELD if held else NOT_HELD,
                   f"At 4 nodes the sparse tree reaches tau {sparse['tau']:.2f} against the "
                   f"chain's {chain['tau']:.2f}.")


MEDUSA_RUNS_COMMAND = """\
python train.py -m experiment=medusa_heads
python train.py drafter=medusa experiment=medusa2 drafter.init_heads=<medusa>
python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/medusa]' \\
    x=drafter.num_heads series=drafter.variant 'where=["data.name=self_distill"]' \\
    name=medusa-runs out_dir=experiments/reports/reproduce"""


def _medusa_runs(reports: Path) -> list[dict]:
    return read_report(reports, "reproduce/medusa-runs.json", "run the commands above")["rows"]


def _run_cells(run: dict, depths: int) -> list[object]:
    top1 = [f"{t:.3f}" for t in run["top1"]] + ["-"] * (depths - len(run["top1"]))
    return [*top1, run["tau"], f"{run['identical']}/{run['prompts']}",
            Path(run["eval"]).parent.name]  # the run's folder: two runs may share a setting


def _head_count(reports: Path) -> Finding:
    runs = sorted((r for r in _medusa_runs(reports) if r["series"] == "medusa1"),
                  key=lambda r: r["x"])
    if len({r["x"] for r in runs}) < 2:
        raise MissingReport("fewer than two head counts among the saved Medusa-1 runs")
    depths = max(len(r["top1"]) for r in runs)
    rows = [[r["x"], *_run_cells(r, depths)] for r in runs]
    fewest, most = runs[0], max(runs, key=lambda r: r["x"])
    return Finding(Table(["heads", *(f"top-1 head {h}" for h in range(depths)),
                          "tau, 16-node tree", "greedy identical", "run"], rows),
                   HELD if most["tau"] > fewest["tau"] + TAU_NOISE else NOT_HELD,
                   f"tau {fewest['tau']:.2f} with {fewest['x']} heads, {most['tau']:.2f} with "
                   f"{most['x']} (each run's own 16-node tree, 8 held-out prompts).")


def _medusa2(reports: Path) -> Finding:
    runs = _medusa_runs(reports)
    two = [r for r in runs if r["series"] == "medusa2"]
    one = [r for r in runs if r["series"] == "medusa1" and two and r["x"] == two[0]["x"]]
    if not two or not one:
        raise MissingReport("the saved Medusa runs lack a Medusa-2 run or a Medusa-1 run "
                            "with as many heads; run the commands above")
    depths = len(two[0]["top1"])
    rows = [["Medusa-1", *_run_cells(r, depths)] for r in one]
    rows.append(["Medusa-2", *_run_cells(two[0], depths)])
    best_one = max(r["tau"] for r in one)
    return Finding(Table(["variant", *(f"top-1 head {h}" for h in range(depths)),
                          "tau, 16-node tree", "greedy identical", "run"], rows),
                   HELD if two[0]["tau"] > best_one + TAU_NOISE else NOT_HELD,
                   f"tau {two[0]['tau']:.2f} for Medusa-2 against {best_one:.2f} for the "
                   f"best Medusa-1 run with {two[0]['x']} heads.")


TYPICAL_BENCH = "reproduce/smollm2-135m-instruct-medusa-medusa_sparse4+*typical*.json"
TYPICAL_COMMAND = """\
python -m experiments.correctness drafter=medusa drafter.checkpoint=<medusa> \\
    tree=medusa_sparse4 out_dir=experiments/reports/correctness
python -m experiments.bench drafter=medusa drafter.checkpoint=<medusa> tree=medusa_sparse4 \\
    temperature=1.0 num_prompts=13 max_new_tokens=128 peers=[] \\
    out_dir=experiments/reports/reproduce \\
    'compare=["medusa:medusa_sparse4:checkpoint=<medusa>,rule=typical,label=typical"]'"""


def _typical_acceptance(reports: Path) -> Finding:
    rows = read_report(reports, "correctness/medusa-*.json", "run the commands above")["rows"]
    drift = {row["rule"]: row for row in rows if "total_variation" in row.get("detail", {})}
    if "typical" not in drift or "sampling" not in drift:
        raise MissingReport("the saved correctness report predates the drift figures; rerun "
                            "the commands above")
    methods = bench_methods(read_report(reports, TYPICAL_BENCH, "run the commands above"))
    speed = {"sampling": method(methods, "medusa/medusa_sparse4"),
             "typical": method(methods, "medusa/medusa_sparse4 (typical)")}
    table = [[rule, speed[rule]["tau"], f"{_speedup(speed[rule]):.2f}x",
              f"{drift[rule]['detail']['total_variation']:.3f}", f"{drift[rule]['value']:.2g}"]
             for rule in ("sampling", "typical")]
    control = drift.get("wrong-residual (control)")
    if control is not None:
        table.append(["wrong-residual (control)", "-", "-",
                      f"{control['detail']['total_variation']:.3f}", f"{control['value']:.2g}"])
    gain = speed["typical"]["tau"] - speed["sampling"]["tau"]
    tv = {rule: drift[rule]["detail"]["total_variation"] for rule in drift}
    return Finding(Table(["acceptance rule", "tau, Spec-Bench, temperature 1",
                          "speedup over hf_sample", "total variation to the target (tiny)",
                          "chi-square p (tiny)"], table),
                   HELD if gain > TAU_NOISE and tv["typical"] > tv["sampling"] else NOT_HELD,
                   f"Typical acceptance raises tau by {gain:+.2f} on Spec-Bench at temperature "
                   f"1 and moves the output {tv['typical']:.3f} (total variation) from the "
                   f"target's distribution, against {tv['sampling']:.3f} for exact sampling "
                   "(its sampling noise).")


MEDUSA = Paper(
    key="medusa",
    title="Cai et al. 2024, Medusa: Simple LLM Inference Acceleration Framework with Multiple "
          "Decoding Heads",
    source="arXiv:2401.10774, abstract; Spec-Bench's leaderboard (hemingkx/Spec-Bench, "
           "Leaderboard.md, RTX 3090 table, commit 09244ff).",
    published=Table(["setting", "speedup", "tau"],
                    [["Medusa-1, Vicuna-7B/13B/33B (paper)", "over 2.2x", "-"],
                     ["Medusa-2, same models (paper)", "2.3x-3.6x", "-"],
                     ["Medusa-1, Vicuna-7B, Spec-Bench on an RTX 3090", "1.44x", "2.32"]]),
    setup=SETUP + " Heads: the default Medusa-1 run (`python train.py drafter=medusa`: K = 4, "
                  "self-distilled data).",
    claims=(
        Claim("Medusa-1 heads speed up decoding",
              "Medusa-1, heads trained on a frozen target, gives over 2.2x without loss of "
              "quality.",
              FLOAT32_COMMAND, _medusa_speed,
              "Heads on a 135M target trained on 87k tokens are right far less often than the "
              "paper's (held-out top-1 by head: README, Training Medusa heads), and every "
              "extra tree token costs here, so the tree sized for this machine drafts one."),
        Claim("A sparse tree beats a chain of the same size",
              "Tree attention over the top candidates of each head, with a tree built from "
              "measured head accuracies, accepts more than a single chain (section 2.1.2, "
              "3.3).",
              REPRODUCE_COMMAND, _sparse_vs_chain,
              "A chain's deeper node counts only when every node above it is right; head 0's "
              "second and third candidates count on their own, so the 4-node tree built from "
              "the measured accuracies (verify.tree_builder) spreads at depth 1. Both trees "
              "cost the same to verify; neither pays for itself on this CPU."),
        Claim("More heads help",
              "Each extra head drafts one more token ahead; the paper uses 4-5 heads.",
              MEDUSA_RUNS_COMMAND, _head_count,
              "Medusa-1 heads are trained independently (only gradient clipping couples "
              "them), so the first heads of every run agree. The 16-node tree each run's "
              "accuracies pick is two levels deep: a third head's token counts only when the "
              "first two are right (~6% of steps here), so heads past the second never enter "
              "it and tau does not move."),
        Claim("Medusa-2 beats Medusa-1",
              "Training the heads together with the target (Medusa-2, a LoRA adapter here) "
              "adds 0.3x-0.7x over Medusa-1.",
              MEDUSA_RUNS_COMMAND, _medusa2,
              "Medusa-2 here is 100 joint steps (a LoRA adapter, rank 8) from the Medusa-1 "
              "heads on 87k self-distilled tokens; the paper fine-tunes the whole 7B model on "
              "its training set with a recipe that keeps the target's quality. The adapter "
              "moves head 1 up and head 3 down, and tau by less than the noise of 8 held-out "
              "prompts (a gap under 0.05 counts as none)."),
        Claim("Typical acceptance buys speed with a bounded drift",
              "Accepting any draft token the target finds plausible enough (a threshold on its "
              "probability, lowered by the entropy) accepts more than rejection sampling and "
              "keeps the output's quality, though not the target's distribution.",
              TYPICAL_COMMAND, _typical_acceptance,
              "Speed is measured on the default target with the trained heads; drift where "
              "exact probabilities can be enumerated: a tiny random target (vocabulary 8, "
              "temperature 1), fresh heads, the first 3 tokens, 3,000 samples per rule. The "
              "drift is a distance between distributions, not the paper's quality score; "
              "the wrong-residual control shows what an outright sampling bug looks like on "
              "the same scale."),
    ),
)


# --- EAGLE ------------------------------------------------------------------------------------

def _eagle_speed(reports: Path) -> Finding:
    return _family_speed(reports, ("eagle/", "eagle3/"), "EAGLE",
                         "EAGLE-1 runs at {best:.2f}x here, the fastest learned drafter, "
                         "against 2.16x (Vicuna-7B, RTX 3090) in Spec-Bench.")


def _data_source(reports: Path) -> Finding:
    rows = read_report(reports, "reproduce/eagle1-data-source.json",
                       "run the runs_table command above")["rows"]
    table_rows = [["self-distilled answers" if r["x"] else f"ShareGPT {r['series']:,} tokens",
                   r["top1"][0], r["top1"][-1], r["tau"]]
                  for r in sorted(rows, key=lambda r: (r["x"], r["series"] or 0))]
    fixed = max((r for r in rows if not r["x"]), key=lambda r: r["series"] or 0)
    own = [r for r in rows if r["x"]]
    if not own:
        raise MissingReport("no self-distilled EAGLE-1 run among the saved rows")
    gap = own[0]["tau"] - fixed["tau"]
    sizes = ", ".join(f"{r['series']:,} tokens {r['tau']:.2f}" for r in
                      sorted((r for r in rows if not r["x"]), key=lambda r: -r["series"]))
    return Finding(Table(["data", "top-1 depth 1", "top-1 depth 5", "tau, 16 nodes"],
                         table_rows),
                   HELD if abs(gap) <= TAU_NOISE else NOT_HELD,
                   f"Self-distilled answers give tau {own[0]['tau']:.2f}; ShareGPT {sizes}: "
                   f"fixed data comes within {abs(gap):.2f} at its largest size.")


def _runs_by_x(reports: Path, name: str, how: str) -> dict:
    return {str(r["x"]): r for r in read_report(reports, name, how)["rows"]}


def _input_ablation(reports: Path) -> Finding:
    runs = _runs_by_x(reports, "reproduce/eagle1-inputs.json", "run the commands above")
    missing = {"both", "tokens", "features"} - set(runs)
    if missing:
        raise MissingReport(f"the saved ablation lacks {sorted(missing)}; run the commands above")
    rows = [[x, runs[x]["top1"][0], runs[x]["top1"][-1], runs[x]["tau"]]
            for x in ("both", "tokens", "features")]
    held = all(runs["both"]["tau"] > runs[x]["tau"] + TAU_NOISE for x in ("tokens", "features"))
    return Finding(Table(["inputs", "top-1 depth 1", "top-1 depth 5", "tau, 16 nodes"], rows),
                   HELD if held else NOT_HELD,
                   f"tau {runs['both']['tau']:.2f} with both inputs, "
                   f"{runs['tokens']['tau']:.2f} with tokens only, "
                   f"{runs['features']['tau']:.2f} with features only (50k ShareGPT tokens, "
                   "800 steps each).")


EAGLE = Paper(
    key="eagle",
    title="Li et al. 2024, EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
    source="arXiv:2401.15077, abstract; Spec-Bench's leaderboard (RTX 3090 table, commit "
           "09244ff).",
    published=Table(["setting", "speedup", "tau"],
                    [["LLaMA2-Chat 70B (paper)", "2.7x-3.5x", "-"],
                     ["Vicuna-7B, Spec-Bench on an RTX 3090", "2.16x", "3.57"]]),
    setup=SETUP + " EAGLE-1: one decoder layer over the target's last features, 8k draft "
                  "vocabulary, trained by `python train.py drafter=eagle`.",
    claims=(
        Claim("EAGLE speeds up decoding more than the other drafters",
              "EAGLE leads Spec-Bench's leaderboard among the methods there.",
              FLOAT32_COMMAND, _eagle_speed,
              "The ranking holds; the size does not: the draft is accepted less often on a 135M "
              "target trained on far less data than the paper's, and one draft token per step "
              "is what this CPU's t(n) affords."),
        Claim("Fixed data works about as well as data the target generates",
              "EAGLE trains on a fixed dataset (ShareGPT) and reports low sensitivity to "
              "training data: regenerating it with the target helps only a little.",
              "python train.py -m drafter=eagle data.sharegpt_tokens=50000,100000,200000,"
              "1000000 optim.max_steps=800\n"
              "python train.py drafter=eagle data.num_prompts=1024 data.sharegpt_tokens=0 "
              "optim.max_steps=800\n"
              "python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/"
              "eagle]' x=data.num_prompts series=data.sharegpt_tokens "
              "'where=[\"optim.max_steps=800\",\"drafter.inputs=both\"]' "
              "'absent=[\"drafter.inputs=both\"]' name=eagle1-data-source "
              "out_dir=experiments/reports/reproduce",
              _data_source,
              "At equal size the target's own answers teach the draft more (1,024 answers, "
              "~87k tokens, beat 100k ShareGPT tokens clearly); fixed data catches up at ten "
              "times the tokens. EAGLE reads the target's features of whatever text it is "
              "given, which is why fixed data works at all."),
        Claim("Feature + shifted token beats token-only and feature-only inputs",
              "The draft's input ablation: both the feature and the next token are needed.",
              "python train.py -m drafter=eagle data.sharegpt_tokens=50000 "
              "drafter.inputs=tokens,features   # both: the 50k run above\n"
              "python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/"
              "eagle]' x=drafter.inputs 'where=[\"data.sharegpt_tokens=50000\"]' "
              "'absent=[\"drafter.inputs=both\"]' name=eagle1-inputs "
              "out_dir=experiments/reports/reproduce",
              _input_ablation,
              "Without the shifted token the draft must guess which token was sampled before "
              "predicting the next feature, and its errors compound with depth; without "
              "features it is a one-layer language model over tokens, equally good at every "
              "depth (it never reads the features it would unroll on) and worse than EAGLE "
              "at each."),
    ),
)


# --- EAGLE-2 ----------------------------------------------------------------------------------

def _dynamic_vs_static(reports: Path) -> Finding:
    methods = _reproduce_bench(reports)
    static, dynamic = method(methods, "eagle/tree8"), method(methods, "eagle/eagle2 (budget 8)")
    rows = [["static tree8", static["tau"], static["draft_ms_per_step"],
             static["verify_ms_per_step"], f"{_speedup(static):.2f}x"],
            ["dynamic, depth 4, top-k 4, 8 nodes", dynamic["tau"], dynamic["draft_ms_per_step"],
             dynamic["verify_ms_per_step"], f"{_speedup(dynamic):.2f}x"]]
    return Finding(Table(["tree", "tau", "draft ms/step", "verify ms/step", "speedup"], rows),
                   HELD if dynamic["tau"] > static["tau"] else NOT_HELD,
                   f"At the same 8 verified nodes the dynamic tree reaches tau "
                   f"{dynamic['tau']:.2f} against the static tree's {static['tau']:.2f}.")


EAGLE2 = Paper(
    key="eagle2",
    title="Li et al. 2024, EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
    source="arXiv:2406.16858, abstract; Spec-Bench's leaderboard (RTX 3090 table, commit "
           "09244ff).",
    published=Table(["setting", "speedup", "tau"],
                    [["three model series, six tasks (paper)", "3.05x-4.26x, 20-40% over "
                      "EAGLE-1", "-"],
                     ["Vicuna-7B, Spec-Bench on an RTX 3090", "2.25x", "4.36"]]),
    setup=SETUP + " The same EAGLE-1 draft (1M ShareGPT tokens) grows both trees.",
    claims=(
        Claim("A dynamic tree accepts more than a static one of the same size",
              "Expanding and reranking by the draft's confidence (context-aware trees) "
              "raises tau over EAGLE's static tree at the same number of verified tokens.",
              REPRODUCE_COMMAND, _dynamic_vs_static,
              "The dynamic tree drafts depth x top-k candidates to keep 8, so it pays more "
              "draft forwards than the static tree's per-level ones."),
    ),
)


# --- EAGLE-3 ----------------------------------------------------------------------------------

def _training_time_test(reports: Path) -> Finding:
    rows = read_report(reports, "eagle3-ttt-steps.json", "run the runs_table command above")[
        "rows"]
    table = [[r["x"], *(f"{t:.3f}" for t in r["top1"]), r["tau"]]
             for r in sorted(rows, key=lambda r: r["x"])]
    one = next(r for r in rows if r["x"] == 1)
    more = [r for r in rows if r["x"] > 1]
    deep_gain = statistics.mean(statistics.mean(r["top1"][1:]) for r in more) / statistics.mean(
        one["top1"][1:])
    held = all(r["tau"] > one["tau"] + TAU_NOISE for r in more)
    depths = [f"top-1 depth {d + 1}" for d in range(len(one["top1"]))]
    return Finding(Table(["ttt steps", *depths, "tau, 16 nodes"], table),
                   HELD if held else NOT_HELD,
                   f"Unrolled training multiplies top-1 at depths 2-5 by {deep_gain:.1f} and "
                   f"raises tau from {one['tau']:.2f} to "
                   f"{max(r['tau'] for r in more):.2f}.")


def _fused_features(reports: Path) -> Finding:
    runs = _runs_by_x(reports, "reproduce/eagle3-features.json", "run the commands above")
    fused, last = runs.get("None"), runs.get("[-1]")
    if fused is None or last is None:
        raise MissingReport("the saved comparison lacks the fused (null) or the last-layer "
                            "([-1]) run; run the commands above")
    rows = [[label, *(f"{t:.3f}" for t in run["top1"]), run["tau"]]
            for label, run in (("fused: layers 2, L/2, L-3", fused), ("last layer", last))]
    depths = [f"top-1 depth {d + 1}" for d in range(len(fused["top1"]))]
    return Finding(Table(["features", *depths, "tau, 16 nodes"], rows),
                   HELD if fused["tau"] > last["tau"] + TAU_NOISE else NOT_HELD,
                   f"tau {fused['tau']:.2f} fused against {last['tau']:.2f} from the last "
                   "layer (50k ShareGPT tokens, 3 unrolled steps, 150 steps each).")


SCALING_COMMAND = """\
python train.py -m experiment=eagle_data_scaling    # EAGLE-1: 50k to 1M tokens, 800 steps each
python train.py -m experiment=eagle3_data_scaling   # EAGLE-3: 50k, 200k, 1M, 400 steps each
python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/eagle]' \\
    x=data.sharegpt_tokens \\
    'where=["optim.max_steps=800","data.num_prompts=0","drafter.draft_vocab_size=8192"]' \\
    name=eagle1-data-scaling out_dir=experiments/reports
python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/eagle3]' \\
    x=data.sharegpt_tokens 'where=["optim.max_steps=400","drafter.ttt_steps=3"]' \\
    name=eagle3-data-scaling out_dir=experiments/reports"""
SCALING_REPORTS = {"eagle": "eagle1-data-scaling.json", "eagle3": "eagle3-data-scaling.json"}


def _data_scaling(reports: Path) -> Finding:
    curves = {name: {r["x"]: r for r in read_report(reports, file, "run the commands above")[
        "rows"]} for name, file in SCALING_REPORTS.items()}
    sizes = sorted(set(curves["eagle"]) & set(curves["eagle3"]))
    if len(sizes) < 2:
        raise MissingReport("the saved curves share fewer than two data sizes; run the "
                            "commands above")
    small, large = sizes[0], sizes[-1]

    def later_depths(run: dict) -> float:
        return statistics.mean(run["top1"][1:])

    gains = {d: c[large]["tau"] - c[small]["tau"] for d, c in curves.items()}
    table = [[d, *(c[x]["tau"] for x in sizes), f"{gains[d]:+.2f}",
              f"{c[small]['top1'][0]:.3f} -> {c[large]['top1'][0]:.3f}",
              f"{later_depths(c[small]):.3f} -> {later_depths(c[large]):.3f}"]
             for d, c in curves.items()]
    return Finding(Table(["drafter", *(f"tau, {x:,} tokens" for x in sizes), "tau gain",
                          "top-1 depth 1", "top-1 depths 2-5"], table),
                   HELD if gains["eagle3"] > gains["eagle"] + TAU_NOISE else NOT_HELD,
                   f"From {small:,} to {large:,} ShareGPT tokens EAGLE-1's tau moves "
                   f"{gains['eagle']:+.2f} and EAGLE-3's {gains['eagle3']:+.2f}.")


EAGLE3 = Paper(
    key="eagle3",
    title="Li et al. 2025, EAGLE-3: Scaling up Inference Acceleration of Large Language Models "
          "via Training-Time Test",
    source="arXiv:2503.01840, abstract.",
    published=Table(["setting", "speedup"],
                    [["chat and reasoning models, five tasks (paper)",
                      "up to 6.5x, about 1.4x over EAGLE-2"]]),
    setup=SETUP + " EAGLE-3 drafts use EAGLE-3's own draft layer (drafter.layout=eagle3, "
                  "the default). The training-time-test and feature runs: 50k ShareGPT "
                  "tokens, 150 steps, batch 4 sequences. The data-scaling runs: each drafter's "
                  "default recipe (EAGLE-1 800 steps, EAGLE-3 400 steps of three unrolled "
                  "passes; batch 8 sequences) at every data size.",
    claims=(
        Claim("Training-time test makes later draft steps accurate",
              "Training the draft on its own unrolled outputs removes the train/test "
              "mismatch of feature-level autoregression.",
              "python train.py -m experiment=eagle3_ttt drafter.layout=eagle3\n"
              "python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/"
              "eagle3/*eagle3_ttt]' x=drafter.ttt_steps 'where=[\"drafter.layout=eagle3\"]' "
              "name=eagle3-ttt-steps out_dir=experiments/reports",
              _training_time_test,
              "With one step the draft never sees its own features, and from depth 2 on it "
              "is right 3-7% of the time; three unrolled steps keep it at 0.16-0.22 to depth "
              "5, against 0.26 at depth 1."),
        Claim("Data scaling: EAGLE-3 gains more from data than EAGLE-1",
              "EAGLE-1's tau flattens with more data; EAGLE-3's keeps rising.",
              SCALING_COMMAND, _data_scaling,
              "Twenty times the data at a fixed step budget, so the large runs see each "
              "token fewer times (EAGLE-1 ~3 epochs of 1M, EAGLE-3 ~1.5). Both drafters gain "
              "alike at every depth: ~+0.1 top-1 at depth 1 and ~+0.07 at depths 2-5 from "
              "50k to 1M; held-out tau (8 prompts) moves within its noise past 200k for "
              "both. EAGLE-1 is far from flat here, so the paper's regime, EAGLE-1 saturated "
              "while EAGLE-3 climbs, begins beyond what this CPU can train (the papers train "
              "on tens of millions of tokens and more). EAGLE-1 runs are from an earlier session, "
              "on the same recipe and data."),
        Claim("Fused low, middle and high features beat the last layer alone",
              "EAGLE-3 feeds the draft three target layers fused to one vector.",
              "python train.py -m experiment=eagle3_features drafter.layout=eagle3\n"
              "python -m experiments.runs_table 'runs=[results/train/smollm2-135m-instruct/"
              "eagle3/*eagle3_features]' x=drafter.feature_layers "
              "'where=[\"drafter.layout=eagle3\"]' name=eagle3-features "
              "out_dir=experiments/reports/reproduce",
              _fused_features,
              "At this scale the difference is within the noise of 8 held-out prompts, and "
              "the last layer alone is ahead at depth 1 (0.30 against 0.26). The "
              "fused input adds a projection (3H -> H) learned from scratch in 150 steps, "
              "while the last layer is already the state the LM head reads; the paper's "
              "gain from fused features comes with its data scaling, which this run does "
              "not reach."),
    ),
)


# --- Spec-Bench -------------------------------------------------------------------------------

MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities"]
COLUMNS = [("multi-turn", MT_BENCH), ("translation", ["translation"]),
           ("summarization", ["summarization"]), ("QA", ["qa"]),
           ("math reasoning", ["math_reasoning"]), ("RAG", ["rag"])]
# Spec-Bench 3090 (Vicuna-7B): EAGLE 2.16x > SpS 1.83x > PLD 1.55x > Medusa 1.44x
LEADERBOARD_ORDER = ["eagle", "draft_model", "prompt_lookup", "medusa"]


DRAFT_MODEL_BENCH = "draft-model/*.json"


def _leaderboard(reports: Path) -> Finding:
    runs = [(FLOAT32_BENCH, bench_methods(read_report(reports, FLOAT32_BENCH,
                                                      "run the command above")))]
    try:  # the distilled draft model (Spec-Bench's SpS) was benchmarked in a run of its own
        draft_run = bench_methods(read_report(reports, DRAFT_MODEL_BENCH, ""))
        runs.append((DRAFT_MODEL_BENCH, {n: m for n, m in draft_run.items()
                                         if n.startswith("draft_model/")}))
    except MissingReport:
        pass
    entries = [(name, figures, source) for source, methods in runs
               for name, figures in methods.items()
               if "tau" in figures and name != "plain_loop"]
    entries.sort(key=lambda e: -_speedup(e[1]))
    rows = [[name, *(f"{statistics.mean(figures['speedup'][c] for c in cats):.2f}x"
                     for _, cats in COLUMNS),
             figures["tau"], f"{_speedup(figures):.2f}x", source.split("/")[0]]
            for name, figures, source in entries]
    best = {}
    for name, figures, _ in entries:
        family = name.split("/")[0]
        best[family] = max(best.get(family, 0.0), _speedup(figures))
    order = [f for f in LEADERBOARD_ORDER if f in best]
    ours = sorted(order, key=lambda f: -best[f])
    return Finding(Table(["method", *(c for c, _ in COLUMNS), "tau", "overall", "run"], rows),
                   HELD if ours == order else NOT_HELD,
                   "Order of the best run of each family here: " + " > ".join(
                       f"{f} {best[f]:.2f}x" for f in ours) + "; Spec-Bench's: EAGLE 2.16x > "
                   "SpS (a draft model) 1.83x > PLD 1.55x > Medusa 1.44x.")


SPEC_BENCH = Paper(
    key="spec_bench",
    title="Xia et al. 2024, Unlocking Efficiency in Large Language Model Inference: A "
          "Comprehensive Survey of Speculative Decoding (Spec-Bench)",
    source="arXiv:2401.07851; hemingkx/Spec-Bench, Leaderboard.md (RTX 3090, Vicuna-7B-v1.3, "
           "greedy, FP16, batch 1, mean of 3 runs; commit 09244ff).",
    published=Table(["method", "multi-turn", "translation", "summarization", "QA",
                     "math reasoning", "RAG", "tau", "overall"],
                    [["EAGLE-2", "2.71x", "1.82x", "2.19x", "2.11x", "2.71x", "1.91x", "4.36",
                      "2.25x"],
                     ["EAGLE", "2.44x", "1.81x", "2.13x", "2.11x", "2.54x", "1.82x", "3.57",
                      "2.16x"],
                     ["SpS (draft model)", "1.98x", "1.37x", "2.00x", "1.95x", "1.89x", "1.76x",
                      "2.29", "1.83x"],
                     ["PLD (prompt lookup)", "1.57x", "1.07x", "2.31x", "1.25x", "1.62x",
                      "1.56x", "1.74", "1.55x"],
                     ["Medusa", "1.60x", "1.38x", "1.28x", "1.46x", "1.64x", "1.22x", "2.32",
                      "1.44x"]]),
    setup=SETUP + " Multi-turn is the mean of the speedups in MT-bench's 8 categories (one "
                  "turn here); the others are Spec-Bench's own categories.",
    claims=(
        Claim("The leaderboard on this machine",
              "Speedup per task category and tau for each method, in one environment; the "
              "order EAGLE > SpS (a separate draft model) > PLD (prompt lookup) > Medusa.",
              FLOAT32_COMMAND + "\n# and the draft models' run: README, Results > Draft models "
              "(experiments/reports/draft-model/)", _leaderboard,
              "EAGLE leads and Medusa trails, as in Spec-Bench; the sizes shrink because a "
              "135M target's drafts are accepted less often and this CPU affords one draft "
              "token a step. The distilled draft model falls behind prompt lookup here: it "
              "sees tokens only, and its two layers cost 4 ms a forward against a 35 ms "
              "target step, a far dearer ratio than a 68M draft for a 7B target. Its rows "
              "come from another run (the run column), each against its own run's "
              "baseline."),
    ),
)

PAPERS = {p.key: p for p in (LEVIATHAN, MEDUSA, EAGLE, EAGLE2, EAGLE3, SPEC_BENCH)}
