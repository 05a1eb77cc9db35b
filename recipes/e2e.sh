#!/usr/bin/env bash
# The end-to-end run on the embedded default: every stage that exists so far, in order.
# Today: create a `tiny` model, save it as a checkpoint, reload it and generate.
# Outputs go to runs/e2e/ (override with OUT=...).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
OUT=${OUT:-runs/e2e}

echo "== init: random tiny model -> $OUT/base"
lathe init --preset tiny --out "$OUT/base" --seed 0

echo "== generate: reload $OUT/base and continue a prompt greedily"
lathe generate "$OUT/base" --prompt-ids 1,2,3,4 --max-new-tokens 16
