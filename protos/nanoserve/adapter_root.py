"""LoRA adapters loaded at run time come from one directory on the workers (--adapter-root).

Anyone who may call LoadAdapter (gRPC) or POST /v1/load_lora_adapter names a directory; only
the worker sees its filesystem, so the worker resolves the name (symlinks, `..`) and reads
nothing that resolves outside the root. The frontend that took the request and the worker
share this contract:

* the wire form: worker.proto `Adapter.path` is either an operator's path (--lora-modules:
  read as given) or, for an adapter loaded at run time, `confined(root, requested)`: the
  root and the requested path joined by NUL, a character no filesystem path holds, so the
  two forms never meet and the engine core between them passes the string on as it is;
* the answers a caller gets: short texts that never hold a host path or an OS error (which
  would tell a caller what exists on the workers); the details go to the worker's log.

No grpc, no torch: both planes import it.
"""
from __future__ import annotations

import os

SEP = "\0"

# What callers are told (gRPC status name, text); each names no path.
DISABLED = ("PERMISSION_DENIED",
            "loading and unloading LoRA adapters at run time is off: start the scheduler with "
            "--adapter-root DIR to allow adapters from that directory on the workers")
OUTSIDE = ("PERMISSION_DENIED",
           "lora_path must name a directory inside the adapter root (a name relative to it, "
           "e.g. `sql` for the root's sql directory)")
NOT_FOUND = ("NOT_FOUND", "adapter not found")
NOT_VALID = ("INVALID_ARGUMENT", "not a valid PEFT adapter")


def confined(root: str, requested: str) -> str:
    """The wire form of `requested` (relative to `root`, or absolute) to be read only from
    inside `root`. Raises ValueError for a requested path holding NUL."""
    if SEP in requested:
        raise ValueError("lora_path holds a NUL character")
    return f"{root}{SEP}{requested}"


def split(path: str) -> tuple[str | None, str]:
    """(root, requested) of a confined wire path; (None, path) of an operator's path."""
    root, sep, requested = path.partition(SEP)
    return (root, requested) if sep else (None, path)


def describe(path: str) -> str:
    """A wire path for a log line (NUL is invisible in one)."""
    root, requested = split(path)
    return path if root is None else f"{requested} under {root}"


def resolve_inside(root: str, path: str) -> str | None:
    """`path` (relative to `root`, or absolute) with every symlink and `..` resolved, or None
    when that lands outside `root` (itself resolved). Whether anything exists there does not
    change the answer, so a refusal reveals nothing of what lies outside."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, path))
    return real if os.path.commonpath([real_root, real]) == real_root else None
