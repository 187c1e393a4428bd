"""LoRA adapters on one rank: read from PEFT's files into host memory, swapped into the
model's `max_loras` GPU slots least-recently-used first (models/lora.py holds the slots).

The scheduler sends every adapter it serves at Init (InitRequest.adapters) and keeps each
step's distinct adapters within max_loras, so a step always fits: the slots it needs are
loaded before its forward, evicting only adapters the step does not use.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file

from kernels.lora import lora_rows
from models.lora import LoraSlots, attach
from nanoserve import adapter_root
from worker_service.step_plan import StepError

log = logging.getLogger("nanoserve.worker")


class AdapterError(ValueError):
    """An adapter that cannot be served (bad files, rank, modules or shapes): clear text, and
    `code`, the gRPC status name SetAdapters answers with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


class _FileError(AdapterError):
    """Its files could not be read or parsed: the text names host paths and OS errors, fit
    for an operator's adapter (--lora-modules), never for a caller's (adapter_root.py)."""


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class HostAdapter:
    name: str
    rank: int
    scale: float
    # per LoraSlots (by id()), its parts' (A, B), this rank's slices, in host memory
    parts: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def _config(file: str, name: str) -> dict:
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _FileError(f"adapter {name}: cannot read {file}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name}: not a LoRA adapter (peft_type "
                           f"{cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r})")
    for key, ok in (("use_dora", not cfg.get("use_dora")), ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
                    ("bias", cfg.get("bias", "none") == "none"),
                    ("modules_to_save", not cfg.get("modules_to_save")),
                    ("rank_pattern", not cfg.get("rank_pattern")),
                    ("alpha_pattern", not cfg.get("alpha_pattern"))):
        if not ok:
            raise AdapterError(f"adapter {name}: {key}={cfg.get(key)!r} is not supported")
    return cfg


def read_adapter(name: str, path: str, targets: dict[str, tuple[LoraSlots, int]],
                 max_rank: int) -> HostAdapter:
    """One PEFT adapter, checked against the model's layers, sliced for this rank. `path`:
    an operator's directory, or a caller's, confined to an adapter root (adapter_root.py)."""
    root, requested = adapter_root.split(path)
    if root is None:
        return _read(name, os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE),
                     targets, max_rank)
    config, weights = _confined_files(name, root, requested)
    try:
        return _read(name, config, weights, targets, max_rank)
    except _FileError as e:
        log.warning("%s", e)
    except AdapterError:
        raise   # rank, modules, shapes: nothing of the host in the text
    except Exception:   # noqa: BLE001 - a caller's file; its text stays in our log
        log.exception("adapter %s: reading %s failed", name, os.path.dirname(config))
    raise _refusal(name, adapter_root.NOT_VALID)


def _refusal(name: str, answer: tuple[str, str]) -> AdapterError:
    code, text = answer
    return AdapterError(f"adapter {name}: {text}", code)


def _confined_files(name: str, root: str, requested: str) -> tuple[str, str]:
    """The adapter's two files, resolved inside `root`; refusals say nothing of the host."""
    directory = adapter_root.resolve_inside(root, requested)
    if directory is None:
        log.warning("adapter %s refused: %r resolves to %s, outside the adapter root %s",
                    name, requested, os.path.realpath(os.path.join(root, requested)), root)
        raise _refusal(name, adapter_root.OUTSIDE)
    if not os.path.isdir(directory):
        log.warning("adapter %s: %s (%r under the adapter root %s) is missing or not a "
                    "directory", name, directory, requested, root)
        raise _refusal(name, adapter_root.NOT_FOUND)
    files = []
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        real = adapter_root.resolve_inside(root, os.path.join(directory, file))
        if real is None:   # a symlink pointing out of the root
            log.warning("adapter %s refused: %s resolves to %s, outside the adapter root %s",
                        name, os.path.join(directory, file),
                        os.path.realpath(os.path.join(directory, file)), root)
            raise _refusal(name, adapter_root.OUTSIDE)
        files.append(real)
    return files[0], files[1]


def _read(name: str, config_file: str, weights_file: str,
          targets: dict[str, tuple[LoraSlots, int]], max_rank: int) -> HostAdapter:
    cfg = _config(config_file, name)
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"adapter {name}: bad rank r={r!r}")
    if r > max_rank:
        raise AdapterError(f"adapter {name}: rank {r} exceeds --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    try:
        weights = load_file(weights_file)
    except Exception as e:   # safetensors raises its own types for a bad header
        raise _FileError(f"adapter {name}: cannot read {weights_file}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in weights.items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"adapter {name}: unexpected tensor {key}")
        pairs.setdefault(module, {})[kind[0]] = t
    if not pairs:
        raise _FileError(f"adapter {name}: no LoRA weights in {weights_file}")
    parts: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in pairs.items():
        if module not in targets:
            raise AdapterError(f"adapter {name}: module {module} is not one this model can "
                               f"adapt (q/k/v/o/gate/up/down projections of dense layers)")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name}: {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        slots, part = targets[module]
        a, b = ab["A"], ab["B"]
        n_in, n_out = slots.full_shapes(part)
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise AdapterError(f"adapter {name}: {module} has A {tuple(a.shape)} and B "
                               f"{tuple(b.shape)}; the base model needs A ({r}, {n_in}) and "
                               f"B ({n_out}, {r})")
        a, b = slots.shard(part, a, b)
        dtype = slots.a.dtype
        parts.setdefault(id(slots), {})[part] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return HostAdapter(name, r, scale, parts)


class AdapterStore:
    """The adapters this rank serves (host memory) and which ones the GPU slots hold."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.ctx, self.targets = attach(model, max_loras, max_rank)
        self.layers: list[LoraSlots] = list({id(s): s for s, _ in self.targets.values()}.values())
        self.adapters: dict[int, HostAdapter] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # adapter id -> slot, LRU first
        # set_adapters (a SetAdapters call's thread) vs slots (the step launcher's): the
        # files are read outside it, the swap inside
        self.lock = threading.Lock()
        self.device = self.layers[0].a.device if self.layers else torch.device("cpu")

    def set_adapters(self, adapters) -> None:
        """Serve exactly these (InitRequest.adapters): read the new ones, forget the rest.
        Raises AdapterError, leaving the previous set in place."""
        current = self.adapters
        loaded = {a.id: (current[a.id] if a.id in current and current[a.id].name == a.name
                         else read_adapter(a.name, a.path, self.targets, self.max_rank))
                  for a in adapters}
        with self.lock:
            for gone in set(self.slot_of) - set(loaded):
                del self.slot_of[gone]   # its slot is free; a new adapter overwrites it
            self.adapters = loaded

    def slots(self, adapter_ids: np.ndarray, num_tokens: np.ndarray) -> np.ndarray | None:
        """Before a forward: each row's adapter (0 = base) -> its tokens' slots [T] (-1:
        the base model), loading the adapters the slots lack (least recently used ones make
        room); None where no row uses one."""
        if not adapter_ids.any():
            return None
        with self.lock:
            return self._slots(adapter_ids, num_tokens)

    def _slots(self, adapter_ids: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        slot_of_row = np.full(len(adapter_ids), -1, dtype=np.int32)
        used = [int(a) for a in np.unique(adapter_ids) if a]
        if len(used) > self.max_loras:
            raise StepError(f"a step uses {len(used)} LoRA adapters; --max-loras is "
                               f"{self.max_loras}")
        for a in used:
            if a not in self.adapters:
                raise StepError(f"unknown LoRA adapter id {a}")
            if a in self.slot_of:
                self.slot_of.move_to_end(a)
        for a in used:
            if a not in self.slot_of:
                self.slot_of[a] = self._free_slot(used)
                self._load(a, self.slot_of[a])
            slot_of_row[adapter_ids == a] = self.slot_of[a]
        return np.repeat(slot_of_row, num_tokens)

    def set_rows(self, slots: np.ndarray | None) -> None:
        """An eager forward's row grouping (the CUDA graphs build theirs from a buffer)."""
        self.ctx.rows = None if slots is None else lora_rows(
            torch.from_numpy(slots).to(self.device), self.max_loras)

    def _free_slot(self, keep: list[int]) -> int:
        taken = set(self.slot_of.values())
        for s in range(self.max_loras):
            if s not in taken:
                return s
        victim = next(a for a in self.slot_of if a not in keep)   # least recently used
        return self.slot_of.pop(victim)

    def _load(self, adapter_id: int, slot: int) -> None:
        ad = self.adapters[adapter_id]
        for layer in self.layers:   # copy_ moves the host tensors into the slot directly
            layer.load(slot, ad.parts.get(id(layer), {}), ad.scale)
