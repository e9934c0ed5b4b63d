#!/usr/bin/env bash
# Set up ./.venv for megatron-dynbatch on a fresh machine.
#
#   bash scripts/setup.sh          # planner, CLI and benchmark only (NumPy, PyYAML, tqdm; no torch)
#   bash scripts/setup.sh --test   # + torch, megatron-core, Ray, pytest/hypothesis: everything the tests need
#
# Without --test, .venv is isolated from the system's site-packages: it holds NumPy, PyYAML, tqdm and this package
# and nothing else, as README says. With --test it sees the system's site-packages, so that an installed torch (often
# a CUDA build matched to the machine's driver) is reused rather than downloaded again; an existing isolated .venv
# is switched over (include-system-site-packages in .venv/pyvenv.cfg) and the script says so. torch is never a
# bare requirement (that pulls gigabytes of CUDA wheels on a CPU machine): without an installed one, CPU machines
# get torch==2.13.0 (override with TORCH_SPEC=...). Transformer Engine / flash-attn are GPU-only extras
# (`pip install -e .[gpu]`) and are never installed here: a half-installed Transformer Engine makes
# `import megatron.core` crash on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (use --test or nothing)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
CFG=.venv/pyvenv.cfg
if [ ! -x .venv/bin/python ]; then
  if [ "$want_test" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
elif [ "$want_test" = 1 ] && grep -Eiq '^include-system-site-packages *= *false' "$CFG"; then
  awk '{ if (tolower($0) ~ /^include-system-site-packages *= *false/) print "include-system-site-packages = true";
         else print }' "$CFG" > "$CFG.new" && mv "$CFG.new" "$CFG"
  echo "setup.sh: .venv now also sees the system's site-packages (--test reuses an installed torch)"
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null

if [ "$want_test" = 1 ]; then
  if "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "setup.sh: reusing installed torch $("$VPY" -c 'import torch; print(torch.__version__)')"
  else
    spec=${TORCH_SPEC:-}
    if [ -z "$spec" ]; then
      if command -v nvidia-smi >/dev/null 2>&1; then spec="torch"; else spec="torch==2.13.0"; fi
    fi
    echo "setup.sh: installing $spec"
    "$VPY" -m pip install -q "$spec"
  fi
  PYTHONWARNINGS=ignore "$VPY" -m pip install -q -e ".[megatron,ray,plot,test]"  # quiet: setuptools' editable-install banner
  # Fail loudly now rather than in the middle of the test run.
  "$VPY" - <<'PYCHECK'
import importlib, sys, warnings
with warnings.catch_warnings(record=True) as caught:  # megatron-core warns once per fallback on CPU machines
    for mod in ("torch", "megatron.core", "ray", "hypothesis", "pytest", "megatron_dynbatch"):
        importlib.import_module(mod)
no_te = [w for w in caught if "Transformer Engine and Apex are not installed" in str(w.message)]
for w in caught:
    if w not in no_te:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
if no_te:
    print("setup.sh: note: megatron-core falls back to torch in %d places (\"Transformer Engine and Apex are not "
          "installed\"): expected on a CPU machine" % len(no_te))
try:
    import transformer_engine  # noqa: F401
    print("setup.sh: note: transformer_engine is importable here (GPU machine?)")
except Exception:
    pass
print("setup.sh: test environment ready (torch %s)" % __import__("torch").__version__)
PYCHECK
else
  PYTHONWARNINGS=ignore "$VPY" -m pip install -q -e .  # quiet: setuptools' editable-install banner
  if grep -Eiq '^include-system-site-packages *= *true' "$CFG"; then
    seen="NumPy, PyYAML, tqdm; it also sees the system's site-packages, as an earlier --test set it up"
  else
    seen="NumPy, PyYAML, tqdm, isolated from the system's site-packages"
  fi
  echo "setup.sh: ready: .venv/bin/megatron-dynbatch (or 'source .venv/bin/activate', then megatron-dynbatch)"
  echo "setup.sh: .venv holds $seen"
fi
