# The router image of deploy/kubernetes/router.yaml: vllm-router (Rust, from PyPI) and nothing else.
#   docker build -f deploy/router.Dockerfile -t jaxpaged-router:0.1.17 deploy
FROM python:3.12-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install vllm-router==0.1.17
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
