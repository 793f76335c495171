#!/usr/bin/env bash
# One-command GPU check for pallas_kernels (JAX 0.11.x, no registry access):
#   1. kernel tests compiled for the GPU (pytest --kernel-mode=gpu),
#   2. benchmarks (scripts/bench_kernels.py) with a summary table.
# Log: "$OUT/gpu_check.log" when $OUT is set. Usage: bash scripts/gpu_check.sh
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
LOG=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; LOG="$OUT/gpu_check.log"; fi

main() {
  local status=0
  echo "== environment ($(date -u +%FT%TZ))"
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  "$PY" - <<'PYEOF'
import sys, jax
print("python", sys.version.split()[0], "| jax", jax.__version__,
      "| backend", jax.default_backend(), "|", jax.devices())
for mod in ("pytest", "hypothesis", "xdist"):
    try:
        __import__(mod); print(f"{mod}: available")
    except ImportError:
        print(f"{mod}: NOT installed" + (" (property tests skip)"
              if mod == "hypothesis" else ""))
PYEOF

  echo "== kernel tests, compiled for GPU"
  if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 200 "$PY" -m pytest tests/pallas_kernels -q -p no:cacheprovider \
      --kernel-mode=gpu --durations=10 || status=1
  else
    echo "pytest not installed: skipping tests"; status=1
  fi

  echo "== kernel benchmarks"
  timeout 150 "$PY" scripts/bench_kernels.py || status=1

  echo "== engine end to end (Llama-3-8B shape, random bf16 weights)"
  timeout 220 "$PY" scripts/bench_engine_gpu.py || status=1

  echo "== gpu_check done: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
  return $status
}

main 2>&1 | tee "$LOG"
