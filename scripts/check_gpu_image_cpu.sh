#!/usr/bin/env bash
# The GPU machine's software, rehearsed on a CPU: Python 3.12, JAX 0.11.2 and
# only flax, transformers and safetensors (no gguf, fastapi, torch), as the H200
# image has. Runs, in a venv of its own (.venv-jax011/):
#   scripts/gpu_check.sh --smoke: the kernel tests in interpret mode, CUDA
#   lowering under an abstract H200 and the sm_90 Triton compile (triton is
#   added here; on the GPU the real compile replaces it), then the benchmark
#   scripts at tiny sizes, so a missing module or an API that JAX 0.11 changed
#   fails here rather than in scarce GPU time.
# Usage: bash scripts/check_gpu_image_cpu.sh   (needs python3.12, e.g. pyenv)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  command -v python3.12 >/dev/null 2>&1 && python3.12 -c "" 2>/dev/null \
    && { command -v python3.12; return; }
  local p
  for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  return 1
}

PY312=$(find_python312) || {
  echo "check_gpu_image_cpu: no Python 3.12 interpreter found" >&2; exit 3; }
VENV=.venv-jax011
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# The H200 image's set (jax 0.11.2, flax, transformers, safetensors) plus what
# the checks themselves need. No `pip install -e .`: gpu_check.sh runs the
# checkout through PYTHONPATH, with whatever the image has.
"$VENV/bin/python" -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" flax \
  transformers safetensors pytest hypothesis "triton==3.9.0"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
"$VENV/bin/python" -c "import jax; print('jax', jax.__version__)"
# The GPU check itself, at smoke sizes: kernel tests (interpret mode, CUDA
# lowering, sm_90 compile), both benchmark scripts and the sweep, the summary.
PYTHON="$VENV/bin/python" bash scripts/gpu_check.sh --smoke
echo "check_gpu_image_cpu: PASS"
