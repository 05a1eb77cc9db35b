#!/usr/bin/env bash
# Create ./.venv (once) and install lathe into it, editable, with the dev extra.
#
# torch is installed first and pinned: on lathe's CPU development and CI machines
# `torch==2.13.0` resolves to the CPU build on local disk, so nothing later pulls a
# multi-GB CUDA build; elsewhere it is the ordinary PyPI build for that machine.
# Set LATHE_TORCH to choose another requirement (e.g. LATHE_TORCH="torch>=2.13").
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "${LATHE_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, lathe.model; print(f'lathe ready: torch {torch.__version__}')"
