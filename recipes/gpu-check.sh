#!/usr/bin/env bash
# Everything lathe checks on a GPU, in priority order, inside one time budget (a short device
# lease): recipes/gpu-smoke.sh with every step (JOBS at once), then the benches, each alone
# on the GPU: pretraining on the 1B shape (bf16, kernels off, compile, FP8, against
# transformers), the chunked and fused linear + cross-entropy against Liger's, a LoRA SFT step
# on the 1B shape against transformers + peft, serving a random-init 1B model (offline
# against transformers, single stream against the copy roofline), the rest of the kernel
# bench, GRPO's rollouts in process against a server of the run's own, synchronous and
# asynchronous, and serving the 1B shape as Qwen3.5 (its CUDA-graph decode steps carrying the
# linear-attention states). It resumes: LEDGER lists "COMMIT STEP" for what passed before, and
# what passed at this COMMIT is not run again (a smoke step still reruns when a step to run
# needs its output). At the end, whatever the budget cut, it writes to OUT: summary.txt (a
# line per step), passed.txt (the ledger with this run's passes added) and logs.tar.gz (every
# log whole).
#
#   COMMIT=$(git rev-parse HEAD) DEADLINE=540 OUT=/tmp/check bash recipes/gpu-check.sh
#   # next lease: copy OUT/passed.txt to LEDGER (default runs/gpu-check/passed.txt) first
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check/out}
PY=${PYTHON:-python}
DEADLINE=${DEADLINE:-540}  # seconds this script may take, the bundling at the end included
LEDGER=${LEDGER:-runs/gpu-check/passed.txt}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
WORK=${WORK:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
export WANDB_MODE=disabled TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
[ -n "$COMMIT" ] || { echo "recipes/gpu-check.sh: set COMMIT (no git checkout here)" >&2; exit 2; }
"$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || {
    echo "recipes/gpu-check.sh needs a CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2; }
mkdir -p "$OUT" "$WORK/logs" "$(dirname "$LEDGER")"
touch "$LEDGER" 2>/dev/null || LEDGER=/dev/null
passed_before=$(awk -v c="$COMMIT" '$1 == c { print $2 }' "$LEDGER" | sort -u | tr '\n' ' ')
cp "$LEDGER" "$OUT/passed.txt" 2>/dev/null || : > "$OUT/passed.txt"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
left() { echo $((DEADLINE - SECONDS - 20)); }  # 20 s kept for the bundling
note() { echo "$*" | tee -a "$SUMMARY"; }
passed() { echo "$COMMIT $1" >> "$OUT/passed.txt"; }

bundle() {
    "$PY" - "$WORK" "$OUT/logs.tar.gz" <<'PY'
import sys, tarfile
from pathlib import Path
work = Path(sys.argv[1])
with tarfile.open(sys.argv[2], "w:gz") as tar:
    for path in sorted(work.rglob("*")):
        if path.is_file() and path.suffix in {".log", ".txt", ".json", ".xml"} \
                and path.stat().st_size < 8 << 20:
            tar.add(path, arcname=str(path.relative_to(work)))
PY
}
trap bundle EXIT

note "gpu-check at $COMMIT, budget ${DEADLINE}s; passed before: ${passed_before:-none}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$SUMMARY"

# 1. the smoke, with the compiled kernel tests among its steps
OUT=$WORK/smoke JOBS=${JOBS:-6} PASSED="$passed_before" PYTHON="$PY" \
    timeout -k 10 "$(left)" bash recipes/gpu-smoke.sh 2>&1 | tee "$WORK/logs/smoke.txt"
grep -h '^PASS' "$WORK/logs/smoke.txt" | awk '{ print $2 }' | while read -r name; do
    passed "$name"; done
cp "$WORK/logs/smoke.txt" "$OUT/smoke.txt"
tee -a "$SUMMARY" < "$WORK/logs/smoke.txt" > /dev/null

# 2. the benches, one at a time, each with the time left (at least NEED seconds)
bench() {  # bench NAME NEED COMMAND...
    local name=$1 need=$2 start=$SECONDS
    shift 2
    if [[ " $passed_before " == *" $name "* ]]; then note "DONE     $name"; return; fi
    if [ "$(left)" -lt "$need" ]; then note "UNREACHED $name (${need}s needed, $(left)s left)"; return; fi
    if timeout -k 10 "$(left)" "$@" > "$WORK/logs/$name.log" 2>&1; then
        passed "$name"
        note "PASS     $(printf '%-22s %4ss' "$name" $((SECONDS - start)))"
    else
        note "FAIL     $(printf '%-22s %4ss' "$name" $((SECONDS - start)))"
    fi
    grep -h '^|' "$WORK/logs/$name.log" >> "$SUMMARY"
}
one_b() {  # a random-init 1B checkpoint in bf16 for the serve bench
    [ -f "$WORK/1B/model.safetensors" ] ||
        "$PY" -m lathe.core init --preset 1b --dtype bfloat16 --out "$WORK/1B"
}
serve_bench() { one_b && "$PY" -m lathe.serve.bench --checkpoint "$WORK/1B" --sections ac --no-write; }
# the 1B shape as Qwen3.5 (three Gated DeltaNet layers in four): its CUDA-graph decode steps
# carry the linear-attention states; transformers runs its PyTorch fallback of
# flash-linear-attention beside it
qwen35_bench() {
    [ -f "$WORK/Q35-1B/model.safetensors" ] || "$PY" -m lathe.core init --preset 1b \
        --family qwen3_5_text --dtype bfloat16 --out "$WORK/Q35-1B"
    "$PY" -m lathe.serve.bench --checkpoint "$WORK/Q35-1B" --sections ac --no-write
}
export -f one_b serve_bench qwen35_bench  # timeout runs programs: each in a bash of its own
export PY WORK
bench bench-pretrain-1b 150 "$PY" -m lathe.pretrain.bench --only 1b --steps 4 --warmup 2 --no-write
bench bench-fused-ce 40 "$PY" -m lathe.kernels.bench --only linear_cross_entropy --no-write
bench bench-lora-1b 100 "$PY" -m lathe.posttrain.bench --only lora --steps 4 --warmup 2 --no-write
bench bench-serve-1b 120 bash -c serve_bench
bench bench-kernels 90 "$PY" -m lathe.kernels.bench --no-write
bench bench-rollouts 150 "$PY" -m lathe.posttrain.rollout_bench --steps 30 --no-write
bench bench-serve-qwen35 150 bash -c qwen35_bench

note "gpu-check: $(grep -c "^$COMMIT " "$OUT/passed.txt") steps passed at $COMMIT; $(left)s left"
