#!/usr/bin/env bash
# The end-to-end run on the embedded default corpus (Python's standard library): every
# stage that exists so far, in order. Outputs go to runs/e2e/ (override with OUT=...);
# a rerun starts from scratch. Each stage's header says how many seconds the run had taken
# when it began. SEED=N seeds every training stage with N instead of the recipes' own
# seeds (how docs/readme-run-quality.md measures the run's spread).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
OUT=${OUT:-runs/e2e}
seed=(${SEED:+"--seed=$SEED"})
rm -rf "$OUT"

echo "== [${SECONDS} s] clean: stdlib .py files and pydoc pages -> $OUT/clean"
lathe clean --recipe recipes/data/stdlib.yaml --input stdlib --output "$OUT/clean"

echo "== [${SECONDS} s] tokenizer: byte-level BPE on the cleaned text -> $OUT/tokenizer"
lathe tokenizer train --input "$OUT/clean" --vocab-size 4096 --max-digits 1 \
    --output "$OUT/tokenizer"

echo "== [${SECONDS} s] shards: tokenize into train/val token shards -> $OUT/shards"
lathe shards --input "$OUT/clean" --tokenizer "$OUT/tokenizer" --output "$OUT/shards"

echo "== [${SECONDS} s] pretrain: the tiny preset on the shards (about 8 minutes on 2 cores) -> $OUT/pretrain"
lathe pretrain --config recipes/pretrain/e2e.yaml --out_dir "$OUT/pretrain" \
    --data.shards "$OUT/shards" --data.tokenizer "$OUT/tokenizer" "${seed[@]}"

echo "== [${SECONDS} s] generate: reload the exported base checkpoint and continue a prompt"
lathe generate "$OUT/pretrain/final" --prompt "def main(" --max-new-tokens 32

echo "== [${SECONDS} s] sft: the chat format on two- and three-digit arithmetic chats, assistant tokens"
echo "   only, until three-digit accuracy passes 60%, then 1,000 steps of decaying rate -> $OUT/sft"
lathe sft --config recipes/sft/e2e.yaml --out_dir "$OUT/sft" --model "$OUT/pretrain/final" \
    "${seed[@]}"

echo "== [${SECONDS} s] dpo: right three-digit results preferred over near misses -> $OUT/dpo"
lathe dpo --config recipes/dpo/e2e.yaml --out_dir "$OUT/dpo" --model "$OUT/sft/final" "${seed[@]}"

echo "== [${SECONDS} s] grpo: exact-answer reward on 8 sampled completions per three-digit"
echo "   prompt -> $OUT/grpo"
lathe grpo --config recipes/grpo/e2e.yaml --out_dir "$OUT/grpo" --model "$OUT/dpo/final" \
    "${seed[@]}"

echo "== [${SECONDS} s] distill: a student of one in two of the chat model's layers (0 and 2, as DistilBERT"
echo "   takes them) learns its distributions -> $OUT/distill"
lathe init --from-teacher "$OUT/grpo/final" --keep-layers 0,2 --out "$OUT/student"
lathe distill --config recipes/distill/e2e.yaml --out_dir "$OUT/distill" \
    --model "$OUT/student" --teacher "$OUT/grpo/final" "${seed[@]}"

echo "== [${SECONDS} s] tools: the chat model learns to call the calculator (SFT on calculator chats),"
echo "   then GRPO with multi-turn tool rollouts -> $OUT/sft-tools, $OUT/grpo-tools"
lathe sft --config recipes/sft/tools.yaml --out_dir "$OUT/sft-tools" --model "$OUT/grpo/final" \
    "${seed[@]}"
lathe grpo --config recipes/grpo/tools.yaml --out_dir "$OUT/grpo-tools" \
    --model "$OUT/sft-tools/final" "${seed[@]}"

echo "== [${SECONDS} s] eval: lm-eval's harness on lathe's engine — the base, SFT and GRPO models on the"
echo "   held-out three-digit problems (recipes/eval) -> $OUT/<stage>/eval.json"
for stage in pretrain sft grpo; do
    lathe eval "$OUT/$stage/final" --tasks lathe_arithmetic3 --include-path recipes/eval \
        --apply-chat-template --output "$OUT/$stage/eval.json"
done

echo "== [${SECONDS} s] report: each stage's metric, curves and samples -> $OUT/report.md"
lathe report "$OUT"

PORT=${PORT:-8765}
SERVER=
trap 'if [ -n "$SERVER" ]; then kill $SERVER 2>/dev/null || true; fi' EXIT
wait_healthy() {
    python - "$PORT" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/health"
deadline = time.monotonic() + 600  # a first start compiles its decode steps (~1 min here)
while time.monotonic() < deadline:
    try:
        if urllib.request.urlopen(url).status == 200:
            break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit("lathe serve did not become healthy; see its log")
PY
}

echo "== [${SECONDS} s] serve: the chat model behind the OpenAI-compatible API, its student drafting"
echo "   speculative tokens, one chat request, then stop"
lathe serve "$OUT/grpo/final" --draft "$OUT/distill/final" --num-speculative-tokens 3 \
    --port "$PORT" --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
wait_healthy
lathe chat "http://127.0.0.1:$PORT" --prompt "What is 382 + 247?" --max-tokens 8 --temperature 0
python - "$PORT" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
print(*(line for line in text.splitlines() if line.startswith("lathe:spec_decode_")), sep="\n")
PY
kill "$SERVER" && wait "$SERVER" 2>/dev/null || true

echo "== [${SECONDS} s] serve the tool model: one question through the OpenAI tool-calling API; the model"
echo "   calls the calculator, lathe chat runs it and sends the result back, the model answers"
lathe serve "$OUT/grpo-tools/final" --tool-call-parser hermes --port "$PORT" \
    --log-level warning > "$OUT/serve-tools.log" 2>&1 &
SERVER=$!
wait_healthy
lathe chat "http://127.0.0.1:$PORT" --tool calculator --prompt "What is 382 + 247?" \
    --max-tokens 80 --temperature 0
kill "$SERVER" && wait "$SERVER" 2>/dev/null || true
echo "== done in ${SECONDS} s: $OUT/grpo/final and $OUT/grpo-tools/final served; server logs in $OUT/serve*.log"
