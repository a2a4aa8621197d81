#!/usr/bin/env bash
# Record benchmark results under bench/results/SET/ (JSON, PNG, Markdown table), one set per
# machine class: SET defaults to cpu-<N>vcpu (N: this machine's CPUs); then regenerate
# docs/benchmarks.md's tables from the files (python bench/results_doc.py).
#
#   bench/record.sh            quick run only (< 60 s)
#   bench/record.sh full       quick run, then the full sweep (several minutes)
#
# Extra arguments after the preset go to the full sweep, e.g.
#   bench/record.sh full --producers 2 --rep-seconds 0.3
# Run on an otherwise idle machine; results are medians of repetitions and
# every method is measured in the same run, so compare ratios, not absolutes
# across machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
OUT=bench/results/${SET:-cpu-$(nproc)vcpu}
mkdir -p "$OUT"
"$PY" -m transfer.cli.bench quick --json "$OUT/quick.json" --plot "$OUT/quick.png" --markdown "$OUT/quick.md"
if [ "${1:-}" = "full" ]; then
    shift
    "$PY" -m transfer.cli.bench full --json "$OUT/full.json" --plot "$OUT/full.png" --markdown "$OUT/full.md" "$@"
fi
