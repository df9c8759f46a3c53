#!/usr/bin/env bash
# What one GPU shows of vime, in about 9 minutes on an H200, one summary line per check:
#
#   bash scripts/gpu_check.sh          # from the project root, on a machine with one CUDA GPU
#
# 1. tests/gpu (flash-attn, NCCL and CUDA vLLM tests skip where those are missing);
# 2. the README's main command, 40 steps, rank and engine sharing the GPU (weights handed over by CUDA
#    IPC, every tensor checked after every push), with each phase's memory;
# 3. spec-scale (scripts/bench/throughput.py) at 1 and 8 rows: synthetic acceptance on a 112 M model;
# 4. a decode step against the GPU's bandwidth limit on the 1.2 B shape (throughput.py step-limit);
# 5. the recipe (scripts/bench/gpu_recipe.py): pretraining a 112 M model with an MTP layer, then 40 RL
#    steps each without speculation, with a frozen and with an online MTP draft: rollout and whole-step
#    speed-ups with the acceptance measured.
#
# A machine that lacks Ray, megatron-core or Hydra gets them from `.gpu/` (a bundle of those packages
# built beside the checkout): when `.gpu/on_device.sh` exists it is sourced first. Each check runs
# under its own time limit (seconds, overridable: TESTS_S, MAIN_S, SCALE_S, LIMIT_S, RECIPE_S; the
# recipe's pretraining RECIPE_PRETRAIN_S), each about 1.5x what it took on an H200; a check that runs
# out says so in its line. Checks 1 and 2 check correctness and run side by side; the timed checks
# 3-5 run alone. CHECKS (default "tests main spec-scale step-limit recipe") runs a subset.
# Logs: $OUT (default runs/gpu_check), one file per check, and summary.txt.
set -u
cd "$(dirname "$0")/.."
if [ -f .gpu/on_device.sh ]; then
  # the bundle's own output goes to a log: on a machine it was not built for it fails loudly, and this
  # script's refusal is one line
  bundle_log=$(mktemp)
  # shellcheck disable=SC1091
  source .gpu/on_device.sh > "$bundle_log" 2>&1 || {
    echo "error: .gpu/on_device.sh failed (its output: $bundle_log); rebuild the bundle on this machine's Python" >&2
    exit 2
  }
fi
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "error: scripts/gpu_check.sh needs a CUDA GPU and torch sees none here; on CPU run python -m pytest -q" >&2
  exit 2
}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
CHECKS=${CHECKS:-tests main spec-scale step-limit recipe}
export RAY_ADDRESS=local PYTHONUNBUFFERED=1 WANDB_MODE=disabled

# check NAME LIMIT_S SUMMARY_COMMAND -- COMMAND...: run COMMAND under its time limit into $OUT/NAME.log,
# then print "NAME: <summary> (<seconds> s)"; the summary command reads the log on stdin
check() {
  local name=$1 limit=$2 summarise=$3
  shift 4
  case " $CHECKS " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS rc line
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  if [ "$rc" = 124 ]; then
    line="timed out after $limit s (see $OUT/$name.log)"
  elif [ "$rc" != 0 ]; then
    line="failed with exit code $rc: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1)"
  else
    line=$(bash -c "$summarise" < "$OUT/$name.log")
  fi
  echo "$name: $line ($((SECONDS - start)) s)" | tee -a "$OUT/summary.txt"
}

# the main command's own test is left to check 2, which runs it for 40 steps rather than 3
check tests "${TESTS_S:-170}" "grep -E '(passed|failed|error)' | tail -1" -- \
  python3 -m pytest -q -rs tests/gpu -k "not main_command" &
check main "${MAIN_S:-130}" "python3 -m scripts.bench.lib.run_summary $OUT/main" -- \
  python3 train_rl.py --enable-mtp-training --mtp-num-layers 1 --num-rollout 40 --no-use-wandb --progress false \
  --check-weight-update-equal --output-dir "$OUT/main"
wait
check spec-scale "${SCALE_S:-60}" "grep -E '^ *(1|8) ' | awk '{print \$1\" rows: online/none \"\$6\", online/frozen \"\$7}' | paste -sd ';'" -- \
  python3 scripts/bench/throughput.py spec-scale --device cuda --dtype bfloat16 --batch-sizes 1,8 --repeats 3
check step-limit "${LIMIT_S:-150}" "grep -E '^ *graphed ' | awk '{print \"graphed step \"\$2\" ms = \"\$3\" of the copy limit, verify 2 / 3 / 4 tokens \"\$5\" \"\$7\" \"\$9\" a plain step, engine \"\$10\" ms a token\"}'" -- \
  python3 scripts/bench/throughput.py step-limit --device cuda --dtype bfloat16 --layers 24 --hidden 2048 --intermediate 5632
check recipe "${RECIPE_S:-470}" "grep '^recipe: ' | tail -1 | cut -c9-" -- \
  python3 scripts/bench/gpu_recipe.py --pretrain-seconds "${RECIPE_PRETRAIN_S:-40}" --steps 40 --out "$OUT/recipe"
echo "summary in $OUT/summary.txt"
