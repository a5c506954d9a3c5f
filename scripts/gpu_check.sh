#!/usr/bin/env bash
# The CUDA path, checked end to end on one CUDA GPU in one command.
#
#   bash scripts/gpu_check.sh [FOLDER]             # one CUDA GPU; FOLDER: where results go
#   bash scripts/gpu_check.sh --dry-run [FOLDER]   # the same steps on the CPU, smallest sizes
#                                                  # (`device=cpu` means the same)
#
# FOLDER defaults to $OUT, else results/gpu-check/<date>-<time> in the repository. In order,
# each step's output in FOLDER/logs/<step>.log, its exit status and wall time in
# FOLDER/summary.json:
#   1. cuda-tests: pytest -m cuda (tests/test_cuda.py and every other cuda-marked test: tiny
#      targets decoding with four drafters, sampling, the compiled step, training, pinned
#      batches, all on the GPU); JUnit XML in FOLDER/pytest-cuda.xml.
#   2. regenerate: the default target (SmolLM2-135M-Instruct, bfloat16) answers 64
#      conversations, 64 new tokens a turn (python -m experiments.regenerate) -> regen/.
#   3. train-eagle3: online EAGLE-3 training on those answers (data=regenerated, features
#      computed live: data.cache_hidden=false), EAGLE3_STEPS steps (1200, meant as ~2 minutes)
#      -> train/eagle3/ (checkpoint, eval.json).
#   4. train-eagle: a short EAGLE-1 training on the same answers, EAGLE_STEPS steps (300)
#      -> train/eagle/.
#   5. correctness-<drafter>-<dtype>: python -m experiments.correctness on the default target
#      on the GPU (target.device=cuda), its greedy row (13 prompts, 64 new tokens against
#      Hugging Face greedy) for prompt_lookup (tree8), eagle and eagle3 (eagle2 trees, the
#      checkpoints of steps 3-4), in float32 and bfloat16 -> correctness/<dtype>/*.json. The
#      distribution and chain rows are left out: they decode a tiny target on the CPU
#      whatever the target's device, as the CPU suite does.
#   6. bench: python -m experiments.bench, the three drafters against Hugging Face greedy and
#      the peers, 13 Spec-Bench prompts, 64 new tokens -> bench/.
# A step that crashes stops the script (non-zero exit). A correctness row that fails its check
# is a measurement and does not stop it; at the end the script fails if a float32 row did
# (float32 is claimed exact for every drafter), while bfloat16 rows are reported only (near
# ties round apart in bfloat16, as measured on the CPU: README, Exactness).
#
# Expected time on one GPU: under 8 minutes. That is an estimate (~1.5 min tests and
# compiling, ~3 min training, ~2.5 min correctness, ~1 min bench): nothing in this project has
# run on a GPU yet. The first run's summary.json gives the real figures; resize EAGLE3_STEPS
# from it to keep train-eagle3 near 2 minutes.
# The dry run (80-130 s on a 2-core CPU shared with other work) executes every step at its
# smallest size: the cuda tests on the CPU (TREEDRAFT_CUDA_TEST_DEVICE=cpu; the compiled step's
# left out); regeneration
# (2 conversations, 8 tokens) and the EAGLE-3 training (2 steps) on the default target, which a
# tiny target cannot stand in for (it has no tokenizer or chat template); the correctness rows
# and bench on a tiny random target, with EAGLE checkpoints from seconds-long
# experiment=eagle_smoke runs on it (one more step: train-eagle3-tiny).
#
# Once run on hardware, its figures go into the README (Results, Limits) and docs/results/,
# generated from the JSON it wrote, as every other figure there.
set -euo pipefail

usage() {
  echo "usage: bash scripts/gpu_check.sh [--dry-run | device=cpu] [FOLDER]" >&2
  exit 2
}

DRY_RUN=false
FOLDER=""
for arg in "$@"; do
  case "$arg" in
    --dry-run | device=cpu) DRY_RUN=true ;;
    -h | --help) usage ;;
    -*) echo "gpu_check: unknown option $arg" >&2; usage ;;
    *) [[ -z "$FOLDER" ]] || usage; FOLDER=$arg ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FOLDER=${FOLDER:-${OUT:-$ROOT/results/gpu-check/$(date +%Y-%m-%d-%H%M%S)}}
OUT=$(realpath -m "$FOLDER")  # absolute: every command runs from the repository root
cd "$ROOT"
# The project's .venv (make setup), else the machine's python3 (a GPU image's own torch);
# PYTHON= picks another.
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# No network on a GPU machine here, and no W&B runs: figures go to JSON only.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled

if $DRY_RUN; then
  DEVICE=cpu
  CHECK_TARGET=tiny_llama          # correctness rows, bench, their EAGLE checkpoints
  REGEN=(regen.conversations=2 regen.max_new_tokens=8 regen.batch_size=2 target.dtype=float32)
  EAGLE3_TRAINING=(optim.max_steps=2 optim.warmup_steps=1 optim.batch_sequences=2
                   data.heldout_prompts=1 data.max_new_tokens=4 eval.num_prompts=1
                   eval.max_new_tokens=4)
  # the checkpoints the tiny target decodes with: seconds-long runs of experiment=eagle_smoke
  TINY_TRAINING=(experiment=eagle_smoke optim.max_steps=2 data.num_prompts=4
                 data.heldout_prompts=1 eval.num_prompts=1 eval.max_new_tokens=4)
  GREEDY=(greedy.num_prompts=1 greedy.max_new_tokens=8)
  BENCH=(num_prompts=1 max_new_tokens=8 'peers=[plain_loop]')
  export TREEDRAFT_CUDA_TEST_DEVICE=cpu  # the cuda-marked tests, run on the CPU
  # but for the compiled step's (~16 s of compiling here; the CPU suite covers it)
  CUDA_TEST_SELECTION=(-k "not compiled")
  export OMP_NUM_THREADS=1               # tiny models: threads cost more than they give
else
  DEVICE=cuda
  CHECK_TARGET=smollm2
  REGEN=(regen.conversations=64 regen.max_new_tokens=64 regen.batch_size=16
         target.dtype=bfloat16)
  # ~2 minutes: the step count is an estimate until the first GPU run times it
  EAGLE3_TRAINING=("optim.max_steps=${EAGLE3_STEPS:-1200}" "save_every=${EAGLE3_STEPS:-1200}")
  EAGLE_TRAINING=("optim.max_steps=${EAGLE_STEPS:-300}" "save_every=${EAGLE_STEPS:-300}")
  CUDA_TEST_SELECTION=()
  GREEDY=()                              # conf/correctness.yaml: 13 prompts, 64 new tokens
  BENCH=(num_prompts=13 max_new_tokens=64)
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: torch sees no CUDA GPU here; on a CPU run: bash scripts/gpu_check.sh --dry-run" >&2
    exit 1
  fi
fi

mkdir -p "$OUT/logs"
CACHE=$(mktemp -d)  # distilled held-out answers and features: this run's own, then removed
trap 'rm -rf "$CACHE"' EXIT
STEPS="$OUT/logs/steps.tsv"
: > "$STEPS"

# run_step NAME COMMAND...: run COMMAND, its output to the terminal and logs/NAME.log, its
# status and times to logs/steps.tsv; a failed command stops the script.
run_step() {
  run_measured_step "$1" "" "${@:2}"
}

# run_measured_step NAME JSON COMMAND...: as run_step, except that exit status 1 with JSON (a glob)
# written is a check that failed (recorded, the script goes on), not a crash: the correctness
# command writes its rows, then exits 1 when one fails.
run_measured_step() {
  local name=$1 json=$2 status=0 started
  shift 2
  started=$EPOCHREALTIME
  printf '\n== %s: %s\n' "$name" "$*"
  "$@" 2>&1 | tee "$OUT/logs/$name.log" || status=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$started" "$EPOCHREALTIME" "$*" >> "$STEPS"
  if (( status != 0 )) && ! { [[ $status == 1 && -n "$json" ]] && compgen -G "$json" >/dev/null; }
  then
    echo "gpu_check: step $name failed (exit $status); its log: $OUT/logs/$name.log" >&2
    exit "$status"
  fi
}

# hydra NAME: where a Hydra command's own files (.hydra/, its log) go for step NAME
hydra() {
  echo "hydra.run.dir=$OUT/logs/hydra/$1"
}

# 1. The CUDA tests, from the files that mark any (collecting the whole suite to select them
# would cost seconds the dry run does not have).
mapfile -t CUDA_TEST_FILES < <(grep -rlE "pytest\.mark\.cuda" tests --include="*.py" | sort)
run_step cuda-tests "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider \
  --junitxml="$OUT/pytest-cuda.xml" "${CUDA_TEST_SELECTION[@]}" "${CUDA_TEST_FILES[@]}"

# 2. Conversations answered by the default target.
run_step regenerate "$PYTHON" -m experiments.regenerate target=smollm2 "${REGEN[@]}" \
  regen.out_dir="$OUT/regen" device="$DEVICE" "$(hydra regenerate)"

# 3-4. EAGLE-3 online on those answers; EAGLE-1 short. In the dry run the checkpoints the
# tiny target decodes with come from eagle_smoke runs on it.
TRAINING=(data=regenerated data.conversations="$OUT/regen" data.cache_hidden=false
          data.cache_dir="$CACHE" device="$DEVICE" logger=none)
run_step train-eagle3 "$PYTHON" train.py drafter=eagle3 "${TRAINING[@]}" \
  "${EAGLE3_TRAINING[@]}" out_dir="$OUT/train/eagle3" "$(hydra train-eagle3)"
if $DRY_RUN; then
  run_step train-eagle3-tiny "$PYTHON" train.py "${TINY_TRAINING[@]}" drafter=eagle3 \
    data.cache_dir="$CACHE" out_dir="$OUT/train/eagle3-tiny" "$(hydra train-eagle3-tiny)"
  run_step train-eagle "$PYTHON" train.py "${TINY_TRAINING[@]}" drafter=eagle \
    data.cache_dir="$CACHE" out_dir="$OUT/train/eagle" "$(hydra train-eagle)"
  EAGLE3_CHECKPOINT="$OUT/train/eagle3-tiny/checkpoint"
else
  run_step train-eagle "$PYTHON" train.py drafter=eagle "${TRAINING[@]}" \
    "${EAGLE_TRAINING[@]}" out_dir="$OUT/train/eagle" "$(hydra train-eagle)"
  EAGLE3_CHECKPOINT="$OUT/train/eagle3/checkpoint"
fi
EAGLE_CHECKPOINT="$OUT/train/eagle/checkpoint"

# 5. Correctness rows: greedy identity with Hugging Face greedy on the GPU, per dtype.
correctness_row() {  # correctness_row DRAFTER TREE DTYPE [OVERRIDE...]
  # each row in a folder of its own (the report's name carries the target and settings), its
  # JSON then moved to correctness/<dtype>/<drafter>-<tree>.json, where summary.json reads it
  local drafter=$1 tree=$2 dtype=$3 dir="$OUT/correctness/$3/$1-$2"
  shift 3
  rm -rf "$dir" "$dir.json"  # a row left by an earlier run must not pass for this one's
  run_measured_step "correctness-$drafter-$dtype" "$dir/*.json" "$PYTHON" \
    -m experiments.correctness \
    target="$CHECK_TARGET" target.device="$DEVICE" target.dtype="$dtype" \
    drafter="$drafter" tree="$tree" "$@" distribution.enabled=false chain.enabled=false \
    "${GREEDY[@]}" out_dir="$dir" "$(hydra "correctness-$drafter-$dtype")"
  mv "$dir"/*.json "$dir.json" && rm -rf "$dir"
}
for dtype in float32 bfloat16; do
  correctness_row prompt_lookup tree8 "$dtype"
  correctness_row eagle eagle2 "$dtype" drafter.checkpoint="$EAGLE_CHECKPOINT"
  correctness_row eagle3 eagle2 "$dtype" drafter.checkpoint="$EAGLE3_CHECKPOINT"
done

# 6. A short bench: the three drafters against Hugging Face greedy, in one run.
run_step bench "$PYTHON" -m experiments.bench target="$CHECK_TARGET" target.device="$DEVICE" \
  drafter=eagle3 tree=eagle2 drafter.checkpoint="$EAGLE3_CHECKPOINT" \
  "compare=[\"eagle:eagle2:checkpoint=$EAGLE_CHECKPOINT\",\"prompt_lookup:tree8\"]" \
  "${BENCH[@]}" logger=none plot=false out_dir="$OUT/bench" "$(hydra bench)"

# summary.json: every step's time and status, every correctness verdict; exits 1 when a
# float32 row failed its check.
"$PYTHON" - "$OUT" "$DRY_RUN" "$DEVICE" <<'PYTHON'
import json
import sys
from pathlib import Path

out, dry_run, device = Path(sys.argv[1]), sys.argv[2] == "true", sys.argv[3]
steps = []
for line in (out / "logs" / "steps.tsv").read_text().splitlines():
    name, status, started, ended, command = line.split("\t", 4)
    steps.append({"step": name, "exit_status": int(status),
                  "seconds": round(float(ended) - float(started), 2), "command": command})
rows = []
for path in sorted((out / "correctness").glob("*/*.json")):
    for row in json.loads(path.read_text())["rows"]:
        rows.append({"dtype": path.parent.name, "drafter": row["drafter"], "tree": row["tree"],
                     "rule": row["rule"], "passed": row["passed"], "value": row["value"],
                     "divergences": len(row["detail"].get("divergences", [])),
                     "tau": row["detail"].get("tau"), "file": str(path.relative_to(out))})
failed = [r for r in rows if r["dtype"] == "float32" and r["passed"] is False]
summary = {"dry_run": dry_run, "device": device,
           "total_seconds": round(sum(s["seconds"] for s in steps), 1),
           "steps": steps, "correctness": rows,
           "float32_failures": [f"{r['drafter']}/{r['tree']}" for r in failed]}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"\n== summary ({out / 'summary.json'}):")
for s in steps:
    print(f"  {s['step']:<36} exit {s['exit_status']}  {s['seconds']:7.1f} s")
for r in rows:
    verdict = {True: "pass", False: "FAIL", None: "measured"}[r["passed"]]
    print(f"  correctness {r['dtype']:<9} {r['drafter']}/{r['tree']}: {r['value']:.3g} "
          f"identical, {verdict}")
print(f"  total {summary['total_seconds']:.0f} s")
if failed:
    print("gpu_check: float32 correctness failed for " + ", ".join(summary["float32_failures"]),
          file=sys.stderr)
    sys.exit(1)
PYTHON
