#!/usr/bin/env bash
# The main job (README's first command): set up the environment if missing, then train a
# small language model with oss_adam on 2 processes and resume it on 1 and on 3.
# Extra arguments go to scripts/demo.py (see --help there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -W ignore scripts/demo.py "$@"
