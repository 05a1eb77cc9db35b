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

# llama.cpp itself, the tests' reference for exported GGUF files (tokens, text, logits):
# node-llama-cpp's prebuilt CPU libraries from the npm registry, pinned to the build whose
# llama.h tests/llama_cpp_runtime.py declares. Without npm, or off Linux x86-64, those
# checks skip.
LLAMA_CPP=.venv/llama.cpp
if [ ! -f "$LLAMA_CPP/libllama.v0.5.0.so" ] && [ "$(uname -sm)" = "Linux x86_64" ] \
        && command -v npm > /dev/null; then
    download=$(mktemp -d)
    if (cd "$download" && timeout 180 npm pack -q --silent @node-llama-cpp/linux-x64@3.22.1 \
            > /dev/null); then
        mkdir -p "$LLAMA_CPP"
        tar -xzf "$download"/*.tgz -C "$LLAMA_CPP" --strip-components=3 package/bins/linux-x64
    else
        echo "llama.cpp not installed (npm pack failed): the GGUF checks against it will skip"
    fi
    rm -rf "$download"
fi
# Without a GPU, build now what the first CPU run would otherwise build and wait for: lathe's
# native CPU kernels (the serve engine's attention, linears and greedy picks) and DeepSpeed's
# shared-memory collective (its CPU ZeRO runs). Each builds once per environment; a failed
# build warns and the PyTorch paths stay.
.venv/bin/python - <<'PY'
import torch
if not torch.cuda.is_available():
    from lathe.kernels.cpu_native import load_cpu_kernels
    load_cpu_kernels()
    try:
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            builder.load(verbose=False)
    except Exception as error:  # a CPU ZeRO run then builds it, or runs without it
        print(f"DeepSpeed's shared-memory collective did not build: {error}")
PY
.venv/bin/python -c "import torch, lathe.model; print(f'lathe ready: torch {torch.__version__}')"
