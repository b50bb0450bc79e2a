#!/usr/bin/env bash
# Run every benchmark with its defaults (or --quick for a smoke run); one JSON
# line per figure on stdout.  Those that need an iggy-server print a
# "skipped" line with the reason when it is not on PATH.
#   bash bench/run_all.sh [--quick] > figures.jsonl
# The full run takes about an hour on the 2-core development VM (fleet and
# failover are the long ones); --quick a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
QUICK=0
[[ "${1:-}" == "--quick" ]] && QUICK=1
for b in ingest drain memory disk dead_letter flood broker_crash command_latency failover receipts fleet device_tls ota; do
    echo "== $b" >&2
    "$PY" "bench/${b}_bench.py" "$@"
done
# The device benchmarks take sizes rather than --quick.
if ((QUICK)); then
    device_args=(--cycles 300)
    heap_args=(--cycles 50 --lo 80 --hi 112 --step 8)
else
    device_args=()
    heap_args=()
fi
echo "== device" >&2
"$PY" bench/device_bench.py "${device_args[@]}"
echo "== device_min_heap" >&2
"$PY" bench/device_min_heap.py "${heap_args[@]}"
