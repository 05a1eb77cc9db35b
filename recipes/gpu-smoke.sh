#!/usr/bin/env bash
# The whole GPU path on one CUDA GPU: data, pretraining in bf16 (eval, export), with compile
# and FP8, killed mid-save and resumed, SFT (full, LoRA and QLoRA), DPO, GRPO, GRPO with tool
# rollouts, distillation, `lathe serve` (HTTP front end and engine core, two processes) under
# a burst of concurrent requests, the Triton kernel tests compiled, and decode steps
# captured as CUDA graphs. One line per step, PASS, FAIL, SKIP or BLOCKED (a step it needs
# failed), each step's log under $OUT; exits non-zero if any step failed or was blocked. W&B
# is off (--logging.report_to=none), so wandb, deepspeed and datasets need not be installed.
#
#   bash recipes/gpu-smoke.sh            # OUT=runs/gpu-smoke, PYTHON=python, JOBS=1
#   SKIP="kill-and-resume kernel-tests" bash recipes/gpu-smoke.sh   # those steps print SKIP
#   JOBS=4 bash recipes/gpu-smoke.sh     # up to 4 steps at once, each as soon as its needs pass
#   PASSED="data kernel-tests" bash recipes/gpu-smoke.sh  # passed before: DONE, not rerun
# A step starts once every step it needs has passed (or was skipped: a skipped step's
# output is then missing, and a step that reads it fails). A PASSED step runs again when a
# step still to run needs its output. The steps are small, so several share one GPU; their
# times are not figures to compare.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-smoke}
PY=${PYTHON:-python}
PORT=${PORT:-8766}
JOBS=${JOBS:-1}
export WANDB_MODE=disabled TRITON_INTERPRET=0
"$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || {
    echo "recipes/gpu-smoke.sh needs a CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2; }
# What the steps import: a module missing on a bare GPU image fails here, at once and by
# name, rather than as a traceback in every step that reaches it minutes later.
"$PY" - <<'PY' || exit 2
import importlib.util, os, sys
needed = ["accelerate", "peft", "transformers", "tokenizers", "safetensors", "trl", "torchao",
          "fastapi", "uvicorn", "httpx", "llguidance", "gguf", "trafilatura"]
skipped = set(os.environ.get("SKIP", "").split()) | set(os.environ.get("PASSED", "").split())
if not {"qlora", "qlora-tests"} <= skipped:  # only the QLoRA steps need it
    needed.append("bitsandbytes")
missing = [name for name in needed if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"recipes/gpu-smoke.sh: missing Python packages: {' '.join(missing)} "
             "(pip install them, or carry their wheels to an offline machine)")
PY
rm -rf "$OUT" && mkdir -p "$OUT"

names=()
declare -A needs runner state pid_step started
step() {  # step NAME "NEEDED STEPS" FUNCTION : declare a step; run_steps runs them
    names+=("$1")
    needs[$1]=$2
    runner[$1]=$3
}

report() {  # report NAME VERDICT [SECONDS]
    case $2 in
        PASS) printf 'PASS     %-22s %4ss\n' "$1" "$3" ;;
        FAIL) printf 'FAIL     %-22s %4ss  (see %s)\n' "$1" "$3" "$OUT/$1.log" ;;
        *) printf '%-8s %-22s\n' "$2" "$1" ;;  # SKIP, DONE or BLOCKED
    esac
}

ready() {  # ready NAME: 0 when every needed step passed or was skipped, 1 when one is still
    local need   # to come, 2 when one failed or was blocked
    for need in ${needs[$1]}; do
        case ${state[$need]} in
            pass|skip) ;;
            fail|blocked) return 2 ;;
            *) return 1 ;;
        esac
    done
}

wanted() {  # the steps to run: all but SKIP's and PASSED's, and every step those need
    local name need i
    for name in "${names[@]}"; do
        [[ " ${SKIP:-} ${PASSED:-} " == *" $name "* ]] || want[$name]=1
    done
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do  # a step is declared after what it needs
        name=${names[i]}
        [ -n "${want[$name]:-}" ] || continue
        for need in ${needs[$name]}; do want[$need]=1; done
    done
}

run_steps() {
    local name running=0 done_pid verdict
    declare -A want
    wanted
    for name in "${names[@]}"; do state[$name]=pending; done
    while :; do
        for name in "${names[@]}"; do
            [ "${state[$name]}" = pending ] || continue
            if [ -z "${want[$name]:-}" ]; then
                state[$name]=skip
                if [[ " ${SKIP:-} " == *" $name "* ]]; then report "$name" SKIP
                else report "$name" DONE; fi
                continue
            fi
            ready "$name"
            case $? in
                2) state[$name]=blocked; report "$name" BLOCKED; continue ;;
                1) continue ;;
            esac
            [ "$running" -lt "$JOBS" ] || continue
            "${runner[$name]}" > "$OUT/$name.log" 2>&1 &
            pid_step[$!]=$name
            started[$name]=$SECONDS
            state[$name]=running
            running=$((running + 1))
        done
        [ "$running" -gt 0 ] || break
        wait -n -p done_pid
        verdict=$?
        name=${pid_step[$done_pid]}
        running=$((running - 1))
        if [ "$verdict" -eq 0 ]; then
            state[$name]=pass; report "$name" PASS $((SECONDS - ${started[$name]}))
        else
            state[$name]=fail; report "$name" FAIL $((SECONDS - ${started[$name]}))
        fi
    done
    for name in "${names[@]}"; do
        case ${state[$name]} in fail|blocked) return 1 ;; esac
    done
}

lathe() { "$PY" -m lathe.core "$@"; }
launch() { "$PY" -m accelerate.commands.launch --config_file recipes/accelerate/gpu.yaml "$@"; }
quiet=(--logging.report_to=none --logging.progress=false)
post=("${quiet[@]}" --task_eval.examples=32 --eval.batches=2)
BASE=$OUT/pretrain/final
SFT=$OUT/sft/final

data() {
    lathe clean --recipe recipes/data/stdlib.yaml --input stdlib --output "$OUT/clean" &&
    lathe tokenizer train --input "$OUT/clean" --vocab-size 4096 --max-digits 1 \
        --output "$OUT/tokenizer" &&
    lathe shards --input "$OUT/clean" --tokenizer "$OUT/tokenizer" --output "$OUT/shards"
}

pretrain() {  # pretrain OUT_NAME EXTRA... : nano on the shards, bf16 from the launch config
    local out=$1
    shift
    launch -m lathe.pretrain --config recipes/pretrain/nano.yaml --out_dir "$OUT/$out" \
        --data.shards "$OUT/shards" --data.tokenizer "$OUT/tokenizer" --max_steps=60 \
        --eval.every=30 --checkpoint.every=20 "${quiet[@]}" "$@"
}
exported() { test -f "$1/final/model.safetensors" && test -f "$1/summary.json"; }

bf16() {
    pretrain pretrain && exported "$OUT/pretrain" &&
    grep -q '"mixed_precision": "bf16"' "$OUT/pretrain/summary.json"
}

compile_fp8() {
    pretrain pretrain-fp8 --precision.compile=true --precision.fp8=true &&
    exported "$OUT/pretrain-fp8" && grep -q '"fp8_layers"' "$OUT/pretrain-fp8/summary.json"
}

kill_and_resume() {  # killed while saving step 40, so the resume starts from step 20
    local killed=$OUT/pretrain-resume.killed.log resumed=$OUT/pretrain-resume.resumed.log
    ! LATHE_FAILPOINT=save-shard@40 pretrain pretrain-resume --precision.compile=true \
        > "$killed" 2>&1 &&
    grep -q 'lathe failpoint: SIGKILL at save-shard@40' "$killed" &&
    pretrain pretrain-resume --precision.compile=true --resume auto > "$resumed" 2>&1 &&
    grep -q 'resumed from step 20' "$resumed" && exported "$OUT/pretrain-resume"
}

sft() {
    lathe sft --config recipes/sft/e2e.yaml --out_dir "$OUT/sft" --model "$BASE" \
        --max_steps=60 --eval.every=30 "${post[@]}"
}
sft_lora() {
    lathe sft --config recipes/sft/e2e.yaml --out_dir "$OUT/sft-lora" --model "$BASE" \
        --max_steps=30 --eval.every=30 --lora.enabled=true --lora.r=16 "${post[@]}"
}
qlora() {  # the base in 4-bit NF4 (bitsandbytes), adapters exported merged and on their own
    lathe sft --config recipes/sft/e2e.yaml --out_dir "$OUT/sft-qlora" --model "$BASE" \
        --max_steps=30 --eval.every=30 --lora.enabled=true --lora.qlora=true --lora.r=16 \
        "${post[@]}" && exported "$OUT/sft-qlora" && test -d "$OUT/sft-qlora/final-adapter"
}
dpo() {
    lathe dpo --config recipes/dpo/e2e.yaml --out_dir "$OUT/dpo" --model "$SFT" \
        --max_steps=30 --eval.every=30 --data.limit=512 "${post[@]}"
}
grpo() {
    lathe grpo --config recipes/grpo/e2e.yaml --out_dir "$OUT/grpo" --model "$SFT" \
        --max_steps=6 --eval.every=6 --beta=0.04 "${post[@]}"
}
sft_tools() {
    lathe sft --config recipes/sft/tools.yaml --out_dir "$OUT/sft-tools" --model "$SFT" \
        --max_steps=40 --eval.every=40 "${post[@]}"
}
grpo_tools() {  # multi-turn episodes: the calculator runs in a bounded child process
    lathe grpo --config recipes/grpo/tools.yaml --out_dir "$OUT/grpo-tools" \
        --model "$OUT/sft-tools/final" --max_steps=4 --eval.every=4 "${post[@]}"
}
distill() {
    lathe distill --config recipes/distill/e2e.yaml --out_dir "$OUT/distill" \
        --model "$BASE" --teacher "$SFT" --max_steps=30 --eval.every=30 "${post[@]}"
}

serve_burst() {
    # The interpreter itself, not the `lathe` function's subshell, so that `kill` reaches
    # the server and its KV cache's GPU memory is free for the steps after this one. A fixed
    # KV budget (the burst needs a few MiB) rather than 90% of the card, so that other
    # steps can share the GPU with it. The engine core runs in a process of its own.
    "$PY" -m lathe.core serve "$SFT" --port "$PORT" --log-level warning \
        --kv-cache-memory-mb 1024 &
    local server=$!
    "$PY" - "$PORT" <<'PY'
import asyncio, sys, time
import httpx
url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 600
started = time.monotonic()
while time.monotonic() < deadline:
    try:
        if httpx.get(f"{url}/health").status_code == 200:
            break
    except httpx.TransportError:
        pass
    time.sleep(0.2)
else:
    sys.exit("lathe serve did not become healthy")
print(f"healthy after {time.monotonic() - started:.1f}s")


def graphs(name):  # decode steps still compiling in the background, or failed to
    metrics = httpx.get(f"{url}/metrics").text
    return float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith(f"lathe:decode_graphs_{name}")))
while graphs("pending"):
    if time.monotonic() > deadline:
        sys.exit("the decode steps were not all built")
    time.sleep(0.5)
if graphs("failed"):
    sys.exit("building the decode steps failed (the server's log says why)")
print(f"decode steps built after {time.monotonic() - started:.1f}s")

async def one(client, i):
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": "final", "max_tokens": 32, "temperature": 0.7, "seed": i,
        "messages": [{"role": "user", "content": f"What is {i} + {i + 7}?"}]})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]

async def burst():
    async with httpx.AsyncClient(timeout=120) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, i) for i in range(64)))
        print(f"64 concurrent requests: {sum(tokens)} tokens in "
              f"{time.perf_counter() - start:.1f}s")
asyncio.run(burst())
PY
    local status=$?
    kill "$server" && wait "$server"
    return $status
}

workers() { "$PY" -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-8}"; }
kernel_tests() {
    # The Triton kernels compiled. The native CPU kernels' tests are CI's: they are CPU code,
    # and a toolchain whose builds crash where an op must raise (seen: Ubuntu 24.04's GCC 13.3
    # on GPU images) has its build refused at load, so there they could only error.
    # shellcheck disable=SC2046  # workers prints nothing or two words
    "$PY" -m pytest -q -rfE $(workers) -m "not native_cpu" tests/kernels
}
# decode steps captured as CUDA graphs against eager, token for token, the engine's KV
# budget on a GPU, and compressed-tensors checkpoints through the Triton quantized matmuls
# (the files' CPU tests are CI's: on a GPU machine they only cost minutes)
decode_graphs() {
    "$PY" -m pytest -q -rfE tests/serve/test_decode_graph.py tests/serve/test_engine.py \
        tests/serve/test_quant_format.py -k cuda
}
qlora_tests() { "$PY" -m pytest -q -rfE tests/posttrain/test_qlora.py; }

step data "" data
step pretrain-bf16 "data" bf16
step pretrain-compile-fp8 "data" compile_fp8
step kill-and-resume "data" kill_and_resume
step sft "pretrain-bf16" sft
step sft-lora "pretrain-bf16" sft_lora
step qlora "pretrain-bf16" qlora
step distill "pretrain-bf16 sft" distill
step dpo "sft" dpo
step grpo "sft" grpo
step serve-burst "sft" serve_burst
step sft-tools "sft" sft_tools
step grpo-tools "sft-tools" grpo_tools
step kernel-tests "" kernel_tests
step decode-graphs "" decode_graphs
step qlora-tests "" qlora_tests

if run_steps; then
    echo "gpu-smoke: all steps passed"
else
    echo "gpu-smoke: FAILED"
    exit 1
fi
