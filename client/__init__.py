"""nanoserve Python client: `Client` (blocking) and `AsyncClient` (asyncio) for the public
gRPC API, plus a CLI (`python -m client --help`)."""

from client.client import (
    DEFAULT_TARGET,
    AsyncClient,
    Client,
    Completion,
    GenerationChunk,
    ModelInfo,
    NanoserveError,
    SamplingParams,
    Stats,
    Usage,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "Client",
    "Completion",
    "GenerationChunk",
    "ModelInfo",
    "NanoserveError",
    "SamplingParams",
    "Stats",
    "Usage",
]
