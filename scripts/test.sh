#!/usr/bin/env bash
# Run the test suite (creating the environment first if needed). Extra arguments go to
# pytest, e.g. scripts/test.sh -k parity -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
