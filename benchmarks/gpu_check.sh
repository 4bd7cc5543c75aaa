#!/usr/bin/env bash
# What one GPU can show that CI cannot, in one table (benchmarks/gpu_check.py says what each
# row runs). Builds .venv first if it is missing; bring a CUDA build of torch into it for a
# real check (the Makefile's pin is the CPU build: `make venv TORCH=torch==2.13.0`, then
# `.venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128`).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s venv
exec .venv/bin/python benchmarks/gpu_check.py "$@"
