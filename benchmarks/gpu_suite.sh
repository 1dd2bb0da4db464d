#!/usr/bin/env bash
# The GPU suite in one command (see benchmarks/gpu_suite.py for what it runs and why).
#
#   bash benchmarks/gpu_suite.sh                 # one CUDA GPU: at most 8 minutes
#   bash benchmarks/gpu_suite.sh --dry-run       # CPU, tiny models: every step, nothing measured
#   bash benchmarks/gpu_suite.sh --out FILE      # results elsewhere (default benchmarks/results/gpu_suite.json)
#
# It checks what it needs before spending any GPU time: python with torch, transformers and
# accelerate importable, and hf_elixir importable from this checkout. DeepSpeed is optional:
# without it (or without a prebuilt CPU Adam) its system records why.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${PYTHON:-python}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if ! "$python" -c "import torch, transformers, accelerate, hf_elixir" 2>/dev/null; then
    echo "gpu_suite: needs torch, transformers, accelerate and hf_elixir importable (pip install -e '.[bench]')" >&2
    exit 2
fi
exec "$python" "$here/gpu_suite.py" "$@"
