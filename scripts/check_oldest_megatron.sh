#!/usr/bin/env bash
# Run `megatron-dynbatch demo --check` (tiny GPT, real megatron-core, 2 CPU ranks: loss, gradients vs the
# unpacked reference) on the OLDEST megatron-core this package supports, in a venv of its own
# (.venv-mcore-oldest), so that the lower bound in pyproject.toml stays true. CI runs it before the test suite,
# which runs on the newest megatron-core pip offers. Fails loudly.
#
#   bash scripts/check_oldest_megatron.sh            # MEGATRON_CORE_OLDEST overrides the version
set -euo pipefail
cd "$(dirname "$0")/.."
REPO_ROOT=$PWD
source "$REPO_ROOT/scripts/_env.sh"   # the interpreter the new venv is made from (like every script here)

OLDEST=${MEGATRON_CORE_OLDEST:-0.15.3}   # keep in step with `megatron-core>=0.15` in pyproject.toml
VENV=${OLDEST_VENV:-.venv-mcore-oldest}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
"$VPY" -m pip install -q "megatron-core==$OLDEST" numpy pyyaml tqdm
"$VPY" -m pip install -q -e . --no-deps
got=$("$VPY" -c "from megatron_dynbatch.megatron.compat import megatron_core_version; print(megatron_core_version())")
if [ "$got" != "$OLDEST" ]; then
  echo "check_oldest_megatron.sh: expected megatron-core $OLDEST in $VENV, found $got" >&2
  exit 1
fi
echo "check_oldest_megatron.sh: megatron-core $got: megatron-dynbatch demo --check"
"$VENV/bin/megatron-dynbatch" demo --check
