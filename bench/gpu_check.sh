#!/usr/bin/env bash
# The prepared GPU check: on a machine with an NVIDIA GPU and nothing prepared, install what
# the package needs from wheels handed to it, build, and record in at most about 9 minutes:
#   bench/results/gpu-DATE-tests.log   pytest -m gpu
#   bench/results/gpu-DATE.{json,log}  transfer-bench's gpu mode (native device workers, and a
#                                      daemon with them off, against CuPy), its share mode (4
#                                      tenants), a remote producer READ into GPU memory against
#                                      raw NIXL (where NIXL's wheel came along), bench/graphs.py's
#                                      MLP, and the targets met or missed ("targets" in the JSON)
# Each part runs under its own timeout and writes as it goes; a part that fails or times out
# leaves the others' results.
#
#   bench/gpu_check.sh [WHEEL_DIR]     (default: .whl; `pip download` them where a registry is
#                                       reachable: trio outcome sniffio pyzmq msgspec, and
#                                       nixl-cu12==1.5.1 with --no-deps for the remote part, for
#                                       the GPU machine's Python; keep them out of git. NIXL's
#                                       wheel (69 MB) passes the device tool's 64 MiB only without
#                                       its nixl_ep_cu12/ torch extensions, which nothing here
#                                       loads: drop those entries and their RECORD lines, 31 MB)
# Results are written to $OUT too when it is set (the device tool's folder).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
WHEELS=${1:-.whl}
PY=${PYTHON:-python3}
DATE=$(date -u +%Y-%m-%d)
RES=bench/results
mkdir -p "$RES"
BASE="$RES/gpu-$DATE"
LOG="$BASE.log"
step() { echo "== $* ($(date -u +%T))" | tee -a "$LOG"; }
: > "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"

step "install"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/transfer-site "$WHEELS"/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    export PYTHONPATH=/tmp/transfer-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 90 "$PY" setup.py -q build_ext --inplace > "$BASE-build.log" 2>&1 || { tail -20 "$BASE-build.log" | tee -a "$LOG"; exit 1; }
rm -f "$BASE-build.log"  # (kept only when the build fails)
"$PY" -c "import transfer, cupy; print('transfer', transfer.__version__, 'cupy', cupy.__version__)" 2>&1 | tee -a "$LOG"

step "pytest -m gpu"
timeout 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 60 tests > "$BASE-tests.log" 2>&1
echo "pytest rc $?: $(tail -1 "$BASE-tests.log")" | tee -a "$LOG"

step "transfer-bench gpu mode"
timeout 170 "$PY" bench/gpu_check.py bench --out "$BASE.json" 2>&1 | grep -v "transfer.daemon.startup" | tee -a "$LOG"

step "share mode (4 tenants)"
timeout 60 "$PY" bench/gpu_check.py share --reps 3 --out "$BASE.json" 2>&1 | grep -v "transfer.daemon.startup" | tee -a "$LOG"

step "remote producer into GPU memory (NIXL)"
timeout 45 "$PY" bench/gpu_check.py remote --sizes 65536,1048576,67108864 --reps 3 --out "$BASE.json" 2>&1 | grep -v "transfer.daemon.startup" | tee -a "$LOG"

step "graphs (MLP, CuPy)"
timeout 70 "$PY" bench/graphs.py --backend cupy --batches 1,16,64,256 --seconds 0.4 --reps 2 --latency 1000 \
    --json "$BASE-graphs.json" 2>&1 | grep -v "transfer.daemon.startup" | tee -a "$LOG"

step "targets"
"$PY" bench/gpu_check.py targets --out "$BASE.json" --graphs "$BASE-graphs.json" 2>&1 | tee -a "$LOG"
rm -f "$BASE-graphs.json"
if [ -n "${OUT:-}" ]; then cp "$BASE.json" "$LOG" "$BASE-tests.log" "$OUT"/ 2>/dev/null; fi
step "done"
