"""What several papers' checks share: the protocol sentence, the two benchmark runs most claims
read (their commands and JSON), the noise floor of held-out tau, and small readers.

Paths in commands: <draft> is a distilled draft model (python train.py drafter=draft_model),
<eagle 1M> EAGLE-1 trained on 1M ShareGPT tokens, <medusa> the default Medusa-1 run; each
one's checkpoint folder.
"""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce.report import (
    NOT_HELD,
    PARTLY,
    Finding,
    MissingReport,
    Table,
    bench_methods,
    read_report,
)

SETUP = ("SmolLM2-135M-Instruct in float32 on this kind of machine (2 CPU cores, no GPU), "
         "greedy, 128 new tokens, Spec-Bench prompts spread round-robin over its 13 "
         "categories; speedup is tokens/s over Hugging Face greedy `generate` of the same "
         "target in the same run; tau is tokens per target forward. The papers ran 7B-70B "
         "targets on GPUs, where verifying tens of tokens costs about what one does; here a "
         "verification of n tokens costs t(n) > t(1) (docs/results/step-cost.md), so small "
         "trees win.")

# One benchmark run behind most claims (experiments/reports/reproduce/).
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
# Held-out tau from a training run's evaluation (8 prompts x 64 tokens, ~300 steps) has a
# standard error of ~0.04 (tokens per step spread ~0.7); a gap below this is no difference.
TAU_NOISE = 0.05


def reproduce_bench(reports: Path) -> dict[str, dict]:
    """The methods of the run behind most claims (REPRODUCE_COMMAND)."""
    return bench_methods(read_report(reports, REPRODUCE_BENCH, "run the command above"))


def speedup(figures: dict) -> float:
    """A method's overall speedup over the run's baseline."""
    return figures["speedup"]["overall"]


def family_speed(reports: Path, prefixes: tuple[str, ...], family: str,
                 sentence: str) -> Finding:
    """Tau and speedup of the float32 side-by-side run's methods starting with `prefixes`;
    `sentence` ("... {best:.2f}x ...") states the best speedup against the paper's."""
    methods = bench_methods(read_report(reports, FLOAT32_BENCH, "run the command above"))
    names = [n for n in methods if n.startswith(prefixes)]
    if not names:
        raise MissingReport(f"the float32 side-by-side run has no {family} method")
    rows = [[n, methods[n]["tau"], f"{speedup(methods[n]):.2f}x"] for n in names]
    best = max(speedup(methods[n]) for n in names)
    return Finding(Table(["method", "tau", "speedup"], rows), PARTLY if best > 1 else NOT_HELD,
                   sentence.format(best=best))


def runs_by_x(reports: Path, name: str, how: str) -> dict:
    """A runs_table report's rows by their x value, as text (None, [-1], tokens ...)."""
    return {str(r["x"]): r for r in read_report(reports, name, how)["rows"]}
