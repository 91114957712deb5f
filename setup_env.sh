#!/usr/bin/env bash
# Makes a virtual environment (default .venv, or $VENV) and installs the project with its test extras.
# torch goes first, pinned: a plain `torch` requirement would pull the CUDA build and gigabytes of packages.
# On a GPU machine set TORCH_SPEC to the build you want (for example TORCH_SPEC="torch==2.13.0").
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
VENV="${VENV:-$ROOT/.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "[setup] installing $TORCH_SPEC"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
# The test extras include DeepSpeed (tests/test_launchers.py), whose build needs torch installed first
echo "[setup] installing rloo_efficient[test]"
"$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
"$VENV/bin/python" -c "import torch, trl, rloo_efficient; print(f'[setup] torch {torch.__version__}, trl {trl.__version__}, rloo_efficient {rloo_efficient.__version__}')"
touch "$VENV/.rloo_efficient_installed"
