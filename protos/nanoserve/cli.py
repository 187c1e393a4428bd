"""Command-line flag groups that more than one entry point takes, each defined once.

`python -m scheduler_service`, `python -m worker_service` and `python -m
scheduler_service.launch` share where to listen, metrics, logging, TLS, the shared
secrets and the adapter root; each calls these on its parser (or one of its argument
groups: `parser` below), so a flag has one name, one default and one environment fallback
everywhere. Only argparse and os here:
`--help` must not import grpc, let alone torch.
"""
from __future__ import annotations

import argparse
import os

API_KEY_ENV = "NANOSERVE_API_KEY"
WORKER_SECRET_ENV = "NANOSERVE_WORKER_SECRET"
# Appended to a secret's help: hides its value, which ArgumentDefaultsHelpFormatter would
# otherwise print (it leaves help that mentions %(default) alone).
_HIDE_DEFAULT = "%(default).0s"


def add_listen_flags(parser, port: int, what: str) -> None:
    """--host and --port: where `what` (e.g. "the public gRPC API") listens."""
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address {what} listens on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=port,
                        help=f"port {what} listens on (0 = any free port; the bound port is "
                             "printed)")


def add_http_port_flag(parser) -> None:
    """--http-port: the scheduler's OpenAI-compatible HTTP API, off when unset."""
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API (/v1/models, "
                             "/v1/completions, /v1/chat/completions, /health) on this port (0 = "
                             "any free port); off when unset. Every frontend serves it, sharing "
                             "the port like --port")


def add_metrics_flags(parser, what: str) -> None:
    """--metrics-port; `what` says what is served there."""
    parser.add_argument("--metrics-port", type=int, default=0,
                        help=f"serve Prometheus metrics at http://<host>:PORT/metrics: {what}; "
                             "0 = none")


def add_logging_flags(parser) -> None:
    parser.add_argument("--log-level", default="INFO")


def add_tls_flags(parser, port: str) -> None:
    """--tls-cert, --tls-key, --tls-client-ca: TLS (mutual with a client CA) on `port`
    (e.g. "the public port"); check them with check_tls_flags."""
    parser.add_argument("--tls-cert", default=None, help=f"PEM certificate: TLS on {port}")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None,
                        help=f"PEM CA: clients of {port} must present a certificate it signed "
                             "(mutual TLS)")


def check_tls_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless the add_tls_flags flags go together."""
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        parser.error("TLS needs --tls-cert and --tls-key (and both for --tls-client-ca)")


def add_adapter_root_flag(parser) -> None:
    """--adapter-root: where LoRA adapters loaded at run time may come from; check it with
    check_adapter_root."""
    parser.add_argument("--adapter-root", default=None, metavar="DIR",
                        help="allow loading and unloading LoRA adapters at run time (gRPC "
                             "LoadAdapter / UnloadAdapter, POST /v1/load_lora_adapter / "
                             "/v1/unload_lora_adapter) from this directory, an absolute path as "
                             "the workers see it. A load names the adapter's directory relative "
                             "to DIR (lora_path `sql` reads DIR/sql); the workers resolve it "
                             "(symlinks, `..`) and refuse anything outside DIR (PERMISSION_DENIED, "
                             "HTTP 403). Any caller of the public API (holding the --api-key, "
                             "when set; with --api-keys, a key with load_adapters) may load any "
                             "adapter under DIR. Unset or empty (the default): both are off "
                             "(PERMISSION_DENIED, HTTP 403); --lora-modules works either way")


def check_adapter_root(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--adapter-root: empty means unset (compose passes `--adapter-root=${ADAPTER_ROOT:-}`);
    a relative path would mean each worker's own working directory: refused."""
    args.adapter_root = args.adapter_root or None
    if args.adapter_root and not os.path.isabs(args.adapter_root):
        parser.error(f"--adapter-root must be an absolute path (as the workers see it), not "
                     f"{args.adapter_root!r}")


def add_api_key_flag(parser) -> None:
    """--api-key, default $NANOSERVE_API_KEY."""
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help="API key every public call but health and reflection must carry "
                             "(authorization: Bearer KEY; else UNAUTHENTICATED, HTTP 401; the "
                             "HTTP API's /health stays open too); none = open. Default: "
                             f"${API_KEY_ENV} (the environment keeps it out of `ps`)."
                             + _HIDE_DEFAULT)


def add_worker_secret_flag(parser, flag: str = "--worker-secret",
                           otherwise: str = "") -> None:
    """The secret between the scheduler and its workers (the worker's --secret, the
    scheduler's --worker-secret), default $NANOSERVE_WORKER_SECRET; `otherwise` tells what
    happens without either."""
    parser.add_argument(flag, default=os.environ.get(WORKER_SECRET_ENV),
                        help="the workers' shared secret: every Worker RPC but Health must carry "
                             "it (authorization: Bearer; the workers' --secret, the scheduler's "
                             f"--worker-secret). Default: ${WORKER_SECRET_ENV}{otherwise}"
                             + _HIDE_DEFAULT)
