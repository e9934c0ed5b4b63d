#!/usr/bin/env bash
# Reproduce the numbers in docs/benchmarks.md: the full default benchmark, its JSON, and (when matplotlib is
# installed) per-rank timelines of one workload. Extra arguments go to `megatron-dynbatch bench`
# (e.g. --seeds 5, --workloads grpo-longcot-8b,large-dp-256).
#
#   benchmarks/run_bench.sh                 # writes tmp/bench/{bench.txt,bench.json,timelines.png}
#   OUT=/some/dir benchmarks/run_bench.sh --seeds 5      # PYTHON=... picks the interpreter (scripts/_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO_ROOT=$PWD
source scripts/_env.sh   # PYTHON: $PYTHON, the active venv, the project's .venv, or python3
PY=$PYTHON
OUT=${OUT:-tmp/bench}
PLOT_WORKLOAD=${PLOT_WORKLOAD:-sft-longctx-70b-cp4-pp4}
mkdir -p "$OUT"
plot=()
if "$PY" -c "import matplotlib" 2>/dev/null; then
  plot=(--plot "$OUT/timelines.png" --plot-workload "$PLOT_WORKLOAD")
fi
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm), $(nproc) CPU(s), $("$PY" --version 2>&1)" | tee "$OUT/bench.txt"
"$PY" -m megatron_dynbatch.cli bench --output "$OUT/bench.json" "${plot[@]}" "$@" | tee -a "$OUT/bench.txt"
