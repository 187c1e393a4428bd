"""Several API keys, each with a name and optional limits (`--api-keys FILE`).

The file is JSON, a list of keys (or {"keys": [...]}):

    [{"name": "web", "key": "sk-web-...", "max_concurrent": 32, "highest_priority": 0,
      "load_adapters": true},
     {"name": "batch", "key": "sk-batch-...", "tokens_per_minute": 2000000,
      "default_priority": 10, "highest_priority": 5}]

name and key are required (names and keys unique); the rest are optional:
  max_concurrent     requests in flight at once (a request of n completions counts n)
  tokens_per_minute  prompt + max_tokens (x n) of the requests admitted in the last 60 s
                     (charged at admission, as OpenAI counts max_tokens; never refunded)
  highest_priority   the smallest priority value the key may ask for (lower runs earlier);
                     asking for less is PERMISSION_DENIED
  default_priority   the priority of its requests that name none (default 0)
  load_adapters      may load and unload LoRA adapters at run time (--adapter-root); false

Frontends check who a caller is and what it may ask for; the engine core, which sees every
frontend's requests, keeps the concurrent and per-minute counts (`Quotas`). Both re-read the
file on SIGHUP (the supervisor passes it on): requests in flight keep running; a file that
does not parse is refused with a log line and the keys before it stay. The key's name goes
with each request (SamplingOptions.tenant): fair shares, metrics and logs use it.
A single `--api-key` is a key named "default" with no limits that may load adapters.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

log = logging.getLogger("nanoserve.keys")

WINDOW_S = 60.0
_FIELDS = {"name": str, "key": str, "max_concurrent": int, "tokens_per_minute": int,
           "highest_priority": int, "default_priority": int, "load_adapters": bool}


@dataclass(frozen=True)
class ApiKey:
    name: str
    max_concurrent: int = 0            # 0: no limit
    tokens_per_minute: int = 0         # 0: no limit
    highest_priority: int | None = None   # None: any priority
    default_priority: int = 0
    load_adapters: bool = False

    def check_priority(self, priority: int) -> str | None:
        """Why this key may not ask for `priority` (None: it may)."""
        if self.highest_priority is not None and priority < self.highest_priority:
            return (f"API key `{self.name}` may ask for priority {self.highest_priority} or "
                    f"lower (a larger value), not {priority}")
        return None


OPEN = ApiKey("")   # no keys configured: anyone, no limits


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse(text: str) -> dict[bytes, ApiKey]:
    """The keys in a file's text, by the digest of their secret; ValueError says what is
    wrong (never echoing a secret)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    entries = data.get("keys") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError("expected a non-empty list of keys (or {\"keys\": [...]})")
    keys: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for i, e in enumerate(entries):
        where = f"key {i + 1}"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: expected an object")
        for field, value in e.items():
            want = _FIELDS.get(field)
            if want is None:
                raise ValueError(f"{where}: unknown field `{field}` (known: {', '.join(_FIELDS)})")
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{where}: `{field}` must be a {want.__name__}")
        name, secret = e.get("name"), e.get("key")
        if not name or not secret:
            raise ValueError(f"{where}: `name` and `key` are required")
        where = f"key `{name}`"
        if name in names:
            raise ValueError(f"{where}: the name is used twice")
        if len(secret) < 8:
            raise ValueError(f"{where}: the key is shorter than 8 characters")
        for field in ("max_concurrent", "tokens_per_minute"):
            if e.get(field, 0) < 0:
                raise ValueError(f"{where}: `{field}` must be >= 0 (0: no limit)")
        d = _digest(secret)
        if d in keys:
            raise ValueError(f"{where}: the same key as `{keys[d].name}`")
        names.add(name)
        keys[d] = ApiKey(name, e.get("max_concurrent", 0), e.get("tokens_per_minute", 0),
                         e.get("highest_priority"), e.get("default_priority", 0),
                         e.get("load_adapters", False))
    return keys


class KeyRing:
    """Who may call: the keys of --api-keys FILE, plus --api-key as "default"."""

    def __init__(self, path: str | None = None, single_key: str | None = None):
        self.path = path
        self.single = {_digest(single_key): ApiKey("default", load_adapters=True)} \
            if single_key else {}
        self.keys: dict[bytes, ApiKey] = {}
        if path:
            self.keys = self._read()

    @property
    def enabled(self) -> bool:
        """Whether callers must present a key."""
        return bool(self.keys or self.single)

    def _read(self) -> dict[bytes, ApiKey]:
        with open(self.path) as f:
            keys = parse(f.read())
        overlap = set(keys) & set(self.single)
        if overlap:
            raise ValueError(f"key `{keys[overlap.pop()].name}` is the same as --api-key")
        return keys

    def reload(self) -> bool:
        """Re-read the file (SIGHUP); a bad file keeps the keys we have."""
        if not self.path:
            return False
        try:
            keys = self._read()
        except (OSError, ValueError) as e:
            log.error("--api-keys %s not reloaded, keeping %d keys: %s", self.path,
                      len(self.keys), e)
            return False
        self.keys = keys
        log.info("--api-keys reloaded: %d keys (%s)", len(keys),
                 ", ".join(sorted(k.name for k in keys.values())))
        return True

    def find(self, token: str | bytes | None) -> ApiKey | None:
        """The key a bearer token is (None: no such key). Looked up by its SHA-256, so no
        comparison's time depends on how much of a secret a caller guessed."""
        if not self.enabled:
            return OPEN
        if not token:
            return None
        if isinstance(token, bytes):
            token = token.decode("utf-8", "replace")
        d = _digest(token)
        return self.keys.get(d) or self.single.get(d)

    def from_bearer(self, header: str | bytes | None) -> ApiKey | None:
        """The key of an `authorization: Bearer <key>` value."""
        if not self.enabled:
            return OPEN
        if isinstance(header, bytes):
            header = header.decode("utf-8", "replace")
        if not header or not header.startswith("Bearer "):
            return None
        return self.find(header[len("Bearer "):])

    def from_metadata(self, metadata: Iterable | None) -> ApiKey | None:
        """The key of a gRPC call's metadata."""
        for k, v in metadata or ():
            if k == "authorization":
                return self.from_bearer(v)
        return self.from_bearer(None)

    def by_name(self, name: str) -> ApiKey | None:
        for k in (*self.keys.values(), *self.single.values()):
            if k.name == name:
                return k
        return None


class Quotas:
    """Concurrent requests and tokens per minute of each key, across every frontend (the
    engine core's). `admit` refuses a request over a limit with the seconds after which it
    may fit (Retry-After); `release` ends a sequence, whatever ended it."""

    def __init__(self, ring: KeyRing):
        self.ring = ring
        self.owner: dict[int, str] = {}        # live seq id -> its key's name
        self.live: Counter[str] = Counter()    # key name -> live sequences
        self._spent: dict[str, deque[tuple[float, int]]] = {}   # (when, tokens), per key
        self._limits: dict[str, ApiKey] = {}
        self.reload()

    def reload(self) -> None:
        self._limits = {k.name: k for k in (*self.ring.keys.values(), *self.ring.single.values())
                        if k.max_concurrent or k.tokens_per_minute}

    def admit(self, seq_id: int, tenant: str, n: int, tokens: int,
              now: float | None = None) -> tuple[str, float] | None:
        """Count a request of n sequences (seq_id .. seq_id + n - 1) that may cost `tokens`;
        or (why not, retry after seconds) and count nothing."""
        key = self._limits.get(tenant) if tenant else None
        if key is not None:
            if key.max_concurrent and self.live[tenant] + n > key.max_concurrent:
                return (f"API key `{tenant}` has {self.live[tenant]} requests in flight, its "
                        f"limit is {key.max_concurrent}", 1.0)
            if key.tokens_per_minute:
                now = time.monotonic() if now is None else now
                spent = self._spent.setdefault(tenant, deque())
                while spent and spent[0][0] <= now - WINDOW_S:
                    spent.popleft()
                used = sum(t for _, t in spent)
                if used + tokens > key.tokens_per_minute:
                    if tokens > key.tokens_per_minute:
                        return (f"the request may cost {tokens} tokens (prompt + max_tokens), "
                                f"more than API key `{tenant}`'s tokens_per_minute "
                                f"{key.tokens_per_minute}: lower max_tokens", WINDOW_S)
                    free_at, left = now, used + tokens - key.tokens_per_minute
                    for when, t in spent:   # the oldest charges leave the window first
                        free_at, left = when + WINDOW_S, left - t
                        if left <= 0:
                            break
                    return (f"API key `{tenant}` used {used} of its {key.tokens_per_minute} "
                            f"tokens per minute", max(free_at - now, 1.0))
                spent.append((now, tokens))
        self.track(seq_id, tenant, n)
        return None

    def track(self, seq_id: int, tenant: str, n: int = 1) -> None:
        """Count sequences without checking (a request resumed after a restart)."""
        if tenant in self._limits:
            for i in range(n):
                self.owner[seq_id + i] = tenant
            self.live[tenant] += n

    def release(self, seq_id: int) -> None:
        tenant = self.owner.pop(seq_id, None)
        if tenant is not None:
            self.live[tenant] -= 1
            if not self.live[tenant]:
                del self.live[tenant]
