#!/usr/bin/env bash
# Run the test suite (creating the environment first if needed). Extra arguments go to
# pytest, e.g. scripts/test.sh -k parity -x. The tests run in two pytest-xdist worker
# processes, a test file to each (pytest.ini); -n 0 runs them in this process alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
