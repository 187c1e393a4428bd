"""What a deployment serves: generation, embeddings or reranker scores (--task).

The same Qwen3 weights serve all three; what differs is a request's last step (a sample,
the pooled hidden state, or P(yes) from two LM head rows). --task names one, or several
joined by commas (e.g. generate,embed: one deployment serving both, their requests batched
together). Workers and the scheduler both resolve `auto` from the checkpoint, by this
rule, first match wins:

  1. the model directory's name contains "rerank"                  -> score (Qwen3-Reranker-*)
  2. sentence-transformers files (modules.json or
     config_sentence_transformers.json), or config.json's
     `architectures` has a bare model class (e.g. "Qwen3Model"),
     or the directory's name contains "embedding"                    -> embed (Qwen3-Embedding-*)
  3. otherwise                                                        -> generate

Plain file reads: the scheduler never imports torch.
"""
from __future__ import annotations

import json
import os

TASKS = ("generate", "embed", "score")

HELP = ("what this deployment serves, one or several joined by commas: generate (Generate / completions), embed (Embed, "
        "/v1/embeddings: last-token pooling, L2-normalised), score (Score, /score, /v1/rerank: "
        "P(yes) vs P(no) at the last position); auto (default): score if the model "
        "directory's name contains 'rerank', embed if it has sentence-transformers files, "
        "a bare model class in config.json's architectures or 'embedding' in its name, "
        "else generate")


def detect(model_dir: str) -> str:
    """The task a checkpoint says it is for (the rule above)."""
    name = os.path.basename(os.path.normpath(model_dir)).lower()
    if "rerank" in name:
        return "score"
    if any(os.path.exists(os.path.join(model_dir, f))
           for f in ("modules.json", "config_sentence_transformers.json")):
        return "embed"
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        archs = []
    if "embedding" in name or any(a.endswith("Model") for a in archs):
        return "embed"
    return "generate"


def resolve(task: str, model_dir: str | None) -> tuple[str, ...]:
    """--task as given (comma-separated), or (auto) what the checkpoint says; generate
    without a model. ValueError names a bad one."""
    if task == "auto":
        return (detect(model_dir) if model_dir else "generate",)
    tasks = tuple(dict.fromkeys(t.strip() for t in task.split(",")))
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"unknown task {bad[0] if bad else task!r}: expected auto or one or "
                         f"more of {', '.join(TASKS)} joined by commas")
    return tasks


def parse(text: str) -> tuple[str, ...]:
    """A comma-joined task list (WorkerInfo.task, ModelInfo.task) as a tuple."""
    return tuple(t for t in text.split(",") if t) or ("generate",)
