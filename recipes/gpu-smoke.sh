#!/usr/bin/env bash
# The whole GPU path in a few minutes on one CUDA GPU: data, pretraining in bf16 (eval,
# export), with compile and FP8, killed mid-save and resumed, SFT (full and LoRA), DPO,
# GRPO, distillation, `lathe serve` under a burst of concurrent requests, the Triton
# kernel tests compiled, and decode steps captured as CUDA graphs. One line per step, PASS
# or FAIL, each step's log under $OUT; exits non-zero if any step failed. W&B is off (--logging.report_to=none), so wandb,
# deepspeed and datasets need not be installed.
#
#   bash recipes/gpu-smoke.sh            # OUT=runs/gpu-smoke, PYTHON=python
#   SKIP="kill-and-resume kernel-tests" bash recipes/gpu-smoke.sh   # those steps print SKIP
# (a step that needs a skipped step's output, such as sft after pretrain-bf16, then fails)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-smoke}
PY=${PYTHON:-python}
PORT=${PORT:-8766}
export WANDB_MODE=disabled TRITON_INTERPRET=0
"$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || {
    echo "recipes/gpu-smoke.sh needs a CUDA GPU (torch.cuda.is_available() is False)" >&2
    exit 2; }
rm -rf "$OUT" && mkdir -p "$OUT"
failed=0

step() {  # step NAME COMMAND... : run it, log it, print PASS/FAIL with its time
    local name=$1 start=$SECONDS
    shift
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        printf 'SKIP  %-22s\n' "$name"
        return
    fi
    if "$@" > "$OUT/$name.log" 2>&1; then
        printf 'PASS  %-22s %4ss\n' "$name" $((SECONDS - start))
    else
        printf 'FAIL  %-22s %4ss  (see %s)\n' "$name" $((SECONDS - start)) "$OUT/$name.log"
        failed=1
    fi
}

lathe() { "$PY" -m lathe.core "$@"; }
launch() { "$PY" -m accelerate.commands.launch --config_file recipes/accelerate/gpu.yaml "$@"; }
quiet=(--logging.report_to=none --logging.progress=false)
post=("${quiet[@]}" --task_eval.examples=32 --eval.batches=2)

data() {
    lathe clean --recipe recipes/data/stdlib.yaml --input stdlib --output "$OUT/clean" &&
    lathe tokenizer train --input "$OUT/clean" --vocab-size 4096 --max-digits 1 \
        --output "$OUT/tokenizer" &&
    lathe shards --input "$OUT/clean" --tokenizer "$OUT/tokenizer" --output "$OUT/shards"
}
step data data

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
step pretrain-bf16 bf16

compile_fp8() {
    pretrain pretrain-fp8 --precision.compile=true --precision.fp8=true &&
    exported "$OUT/pretrain-fp8" && grep -q '"fp8_layers"' "$OUT/pretrain-fp8/summary.json"
}
step pretrain-compile-fp8 compile_fp8

kill_and_resume() {  # killed while saving step 40, so the resume starts from step 20
    local killed=$OUT/pretrain-resume.killed.log resumed=$OUT/pretrain-resume.resumed.log
    ! LATHE_FAILPOINT=save-shard@40 pretrain pretrain-resume --precision.compile=true \
        > "$killed" 2>&1 &&
    grep -q 'lathe failpoint: SIGKILL at save-shard@40' "$killed" &&
    pretrain pretrain-resume --precision.compile=true --resume auto > "$resumed" 2>&1 &&
    grep -q 'resumed from step 20' "$resumed" && exported "$OUT/pretrain-resume"
}
step kill-and-resume kill_and_resume

BASE=$OUT/pretrain/final
step sft lathe sft --config recipes/sft/e2e.yaml --out_dir "$OUT/sft" --model "$BASE" \
    --max_steps=60 --eval.every=30 "${post[@]}"
step sft-lora lathe sft --config recipes/sft/e2e.yaml --out_dir "$OUT/sft-lora" \
    --model "$BASE" --max_steps=30 --eval.every=30 --lora.enabled=true --lora.r=16 "${post[@]}"
step dpo lathe dpo --config recipes/dpo/e2e.yaml --out_dir "$OUT/dpo" --model "$OUT/sft/final" \
    --max_steps=30 --eval.every=30 --data.limit=512 "${post[@]}"
step grpo lathe grpo --config recipes/grpo/e2e.yaml --out_dir "$OUT/grpo" \
    --model "$OUT/sft/final" --max_steps=6 --eval.every=6 --beta=0.04 "${post[@]}"
step distill lathe distill --config recipes/distill/e2e.yaml --out_dir "$OUT/distill" \
    --model "$BASE" --teacher "$OUT/sft/final" --max_steps=30 --eval.every=30 "${post[@]}"

serve_burst() {
    # The interpreter itself, not the `lathe` function's subshell, so that `kill` reaches
    # the server and its KV cache's GPU memory is free for the steps after this one. A fixed
    # KV budget (the burst needs a few MiB) rather than 90% of the card, so that tests can
    # share the GPU with it.
    "$PY" -m lathe.core serve "$OUT/sft/final" --port "$PORT" --log-level warning \
        --kv-cache-memory-mb 1024 &
    local server=$!
    "$PY" - "$PORT" <<'PY'
import asyncio, sys, time
import httpx
url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 600  # the start captures a CUDA graph per batch bucket
while time.monotonic() < deadline:
    try:
        if httpx.get(f"{url}/health").status_code == 200:
            break
    except httpx.TransportError:
        pass
    time.sleep(0.2)
else:
    sys.exit("lathe serve did not become healthy")

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
step serve-burst serve_burst

kernels() {
    if "$PY" -c "import xdist" 2>/dev/null; then
        "$PY" -m pytest -q -n 12 tests/kernels
    else
        "$PY" -m pytest -q tests/kernels
    fi
}
step kernel-tests kernels
# decode steps captured as CUDA graphs against eager, token for token, and the engine's KV
# budget on a GPU (the file's CPU tests are CI's: on a GPU machine they only cost minutes)
step decode-graphs "$PY" -m pytest -q tests/serve/test_decode_graph.py tests/serve/test_engine.py \
    -k cuda

if [ $failed -eq 0 ]; then echo "gpu-smoke: all steps passed"; else echo "gpu-smoke: FAILED"; fi
exit $failed
