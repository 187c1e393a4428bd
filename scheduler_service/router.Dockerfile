# vllm-router (PyPI `vllm-router`, a Rust binary; the pin matches pyproject's dev extra) in
# front of the replicas' OpenAI HTTP APIs: docker-compose.yml's profile `replicas`. Its
# kv_aware policy reads every scheduler's KV events (--kv-events-config) and /tokenize.
# Build context: this folder.
#   docker build -f scheduler_service/router.Dockerfile -t nanoserve-router scheduler_service
# Behind a TLS-intercepting proxy, pip gets the CA bundle as a build secret (never a layer):
#   docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt ...
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE}
ARG VLLM_ROUTER_VERSION=0.1.17
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=secret,id=pip_ca \
    python3 -m venv /opt/router \
 && if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && /opt/router/bin/pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}" \
 && rm -rf /root/.cache
USER nobody
EXPOSE 8090
ENTRYPOINT ["/opt/router/bin/vllm-router"]
