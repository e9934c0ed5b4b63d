# Sourced (never run) by every script of this repository that starts Python: scripts/*.sh,
# scripts/sbatch/*.sbatch, benchmarks/*.sh. It picks the interpreter once, the same way everywhere, so that a
# documented command works as written after `bash scripts/setup.sh` whether or not .venv is activated:
#
#   1. $PYTHON, when set (e.g. PYTHON=/opt/conda/bin/python bash scripts/...);
#   2. the active virtual environment's python ($VIRTUAL_ENV/bin/python, after `source .../bin/activate`);
#   3. the project's own .venv (made by scripts/setup.sh): $REPO_ROOT/.venv/bin/python;
#   4. python3 from PATH (e.g. an NGC container that has torch, Transformer Engine and Megatron-LM).
#
# The caller sets REPO_ROOT first. Afterwards PYTHON holds the choice and PYTHON_SOURCE says where it came from.
# shellcheck shell=bash

if [ -n "${PYTHON:-}" ]; then
  PYTHON_SOURCE='$PYTHON'
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PYTHON=$VIRTUAL_ENV/bin/python
  PYTHON_SOURCE='the active virtual environment'
elif [ -x "${REPO_ROOT:?_env.sh needs REPO_ROOT}/.venv/bin/python" ]; then
  PYTHON=$REPO_ROOT/.venv/bin/python
  PYTHON_SOURCE="the project's .venv"
else
  PYTHON=python3
  PYTHON_SOURCE='PATH; there is no .venv: bash scripts/setup.sh makes one, PYTHON=... picks another'
fi
