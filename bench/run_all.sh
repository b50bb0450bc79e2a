#!/usr/bin/env bash
# Run every benchmark with its defaults (or --quick for a smoke run); one JSON
# line per figure on stdout, in the order ingest, drain, memory, disk, dead_letter.
#   bash bench/run_all.sh [--quick] > figures.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for b in ingest drain memory disk dead_letter flood broker_crash; do
    echo "== $b" >&2
    "$PY" "bench/${b}_bench.py" "$@"
done
