#!/usr/bin/env bash
# Benchmark (see scripts/bench.py --help): sets up the environment, adds matplotlib for
# the chart, and runs the four contenders. --quick: under 5 minutes; full: under 30.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -c "import matplotlib" 2>/dev/null \
  || .venv/bin/python -m pip --disable-pip-version-check -q install -c constraints.txt matplotlib
export OMP_NUM_THREADS=1
exec .venv/bin/python -W ignore scripts/bench.py "$@"
