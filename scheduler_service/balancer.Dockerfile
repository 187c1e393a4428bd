# nginx in front of two nanoserve replicas: the balancer of docker-compose.cpu.yml's profile
# `replicas` (scheduler_service/nginx.conf; Envoy, docker-compose.yml's, needs a registry).
# Build context: this folder.
#   docker build -f scheduler_service/balancer.Dockerfile -t nanoserve-balancer scheduler_service
# BASE_IMAGE is the scheduler's (any Debian bookworm image): nginx comes from Debian's archive
# through the base's own apt sources (bookworm's nginx 1.22 has HTTP/2 and grpc_pass built in).
# Behind a TLS-intercepting proxy, apt gets the CA bundle as a build secret (never a layer):
#   docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt ...
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE}
RUN --mount=type=secret,id=pip_ca \
    export DEBIAN_FRONTEND=noninteractive \
 && if [ -s /run/secrets/pip_ca ]; then CA="-o Acquire::https::CAInfo=/run/secrets/pip_ca"; fi \
 && apt-get $CA update -qq \
 && apt-get $CA install -y -qq --no-install-recommends nginx > /dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /etc/nginx/sites-enabled /etc/nginx/conf.d \
           /usr/share/doc/* /usr/share/man/* \
 && nginx -V 2>&1 | grep -q -- --with-http_v2_module
COPY nginx.conf /etc/nginx/nginx.conf
# Debian's www-data: nginx needs no root to listen on ports > 1024 (its temp files and pid
# go to /tmp, its logs to stderr).
USER www-data
WORKDIR /tmp
EXPOSE 50050 8080
# SIGQUIT: finish the streams in flight, then exit (compose's stop_signal).
STOPSIGNAL SIGQUIT
CMD ["nginx", "-e", "stderr", "-g", "daemon off;"]
