#!/usr/bin/env bash
# Create (or bring up to date) the project's virtual environment in .venv, on a machine
# that has nothing but Python 3.11. Safe to run again: dependencies are installed only
# when requirements.txt or constraints.txt changed; the package itself is reinstalled
# each time (seconds), so .venv always runs the code in this checkout.
#
# Order matters: torch==2.13.0 first (the CPU wheel; unpinned, pip takes a CUDA build of
# several GB), then fairseq from the ve-fairseq wheel with --no-deps (its metadata asks
# for torchaudio, which would replace torch), then fairseq's real needs.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

stamp="$VENV/.fairseq-oss-deps"
want=$(cat constraints.txt requirements.txt scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing torch 2.13.0 (CPU), fairseq (ve-fairseq, --no-deps) and their needs"
  "${PIP[@]}" install -c constraints.txt torch==2.13.0
  "${PIP[@]}" install --no-deps ve-fairseq==0.12.3
  "${PIP[@]}" install -c constraints.txt -r requirements.txt
  # fairscale: for --zero-sharding os (tests resume its checkpoints; the benchmark runs
  # it). Pure Python; --no-deps so that it cannot replace torch.
  "${PIP[@]}" install --no-deps fairscale==0.4.13
  echo "$want" > "$stamp"
fi
# setuptools' build/ keeps every module an earlier build had, and puts them in the wheel:
# a module that moved or was removed would still be installed. Build from scratch.
rm -rf build fairseq_oss.egg-info
"${PIP[@]}" uninstall -y fairseq-oss >/dev/null 2>&1 || true
# --no-build-isolation: built with this environment's setuptools (pinned in constraints.txt)
# rather than the newest release on the index, which a build in isolation would fetch.
"${PIP[@]}" install --no-deps --no-build-isolation . 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -W ignore - <<'PY'
import torch, fairseq_oss
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
import fairseq
from fairseq.optim import OPTIMIZER_REGISTRY
assert "oss_adam" in OPTIMIZER_REGISTRY, "oss_adam did not register"
PY
echo "setup: ready ($VENV: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), fairseq-oss $("$VENV/bin/python" -c 'import fairseq_oss; print(fairseq_oss.__version__)'))"
