"""One request as the scheduler sees it: its token ids, its KV placement, its progress.

A Sequence holds every token id it has (prompt + generated), so the scheduler can always
rebuild its KV by re-prefilling: after a preemption or after a worker restart.
Pure Python: the scheduler service never imports torch.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_service.speculation import SpecState


# Placeholder for a token sampled by a step still in flight (overlap scheduling): the
# worker substitutes the id it sampled for this sequence in the previous step.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # in Scheduler.waiting: not started, mid chunked prefill, or preempted
    RUNNING = enum.auto()   # in Scheduler.running: prompt computed, decoding one token a step
    FINISHED = enum.auto()  # done; its blocks are released


@dataclass
class SamplingOptions:
    """What the worker needs to sample and the scheduler needs to stop (validated elsewhere)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    n: int = 1                        # completions of the prompt (sibling sequences)
    repetition_penalty: float = 1.0   # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0             # k most likely ids per step (0 = off)
    grammar: str = ""                 # llguidance grammar the output must follow ("" = free)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (id, bias) added to the logits
    min_tokens: int = 0               # stop ids cannot end the output before this many tokens
    prediction: tuple[int, ...] = ()  # the caller's guess at the output: proposed ahead
    speculate: bool = True            # False: never propose tokens for this request
    adapter_id: int = 0               # LoRA adapter (engine core's numbering), 0 = the base
    # Serving many callers (wait_queue.py): not sampling, but what travels with a request
    # from the frontend to the scheduler.
    priority: int = 0                 # lower = earlier (vLLM's meaning)
    tenant: str = ""                  # the API key's name: quotas and fair shares
    deadline: float = 0.0             # time.monotonic() the caller gives up at; 0 = none
    # A pooling request (embeddings, reranker scores: pooling.py): WorkerPooling's kind
    # (0: none, it generates), its matryoshka dimensions (0: all), a score's (yes, no) ids.
    # It runs as a prompt with max_tokens 1 whose one "sample" is the pooled answer.
    pooling: int = 0
    dimensions: int = 0
    score_ids: tuple[int, ...] = ()

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def sibling_options(opts: SamplingOptions, i: int) -> SamplingOptions:
    """Completion i of a request of opts.n as a sequence of its own: n = 1, seeded with
    seed + i (the engine core's siblings, and a frontend resuming one after a restart)."""
    return dataclasses.replace(opts, n=1, seed=None if opts.seed is None
                               else (opts.seed + i) & 0xFFFFFFFFFFFFFFFF)


@dataclass(eq=False)  # identity equality: two requests with the same tokens are still two
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + generated
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    num_prompt_tokens: int = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Progress counters. Invariant: num_cached_tokens <= num_computed_tokens <= num_tokens.
    num_cached_tokens: int = 0    # prompt tokens served by prefix-cache hits at the last allocate()
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (cached + computed)
    num_scheduled_tokens: int = 0  # tokens to compute in the current step
    num_hashed_blocks: int = 0    # leading full blocks registered in the hash table (BlockManager's)
    # The chained hashes of its leading full blocks, as far as computed (BlockManager.block_hash)
    block_hashes: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0   # trailing PENDING_TOKEN placeholders (steps in flight)
    # Samples of steps in flight already known: fast-forward put the token its grammar
    # forces in their place (the worker samples that token); resolve skips them, oldest first.
    ahead: list[int] = field(default_factory=list)
    # Prompt tokens served from the prefix cache at first admission: what usage reports
    # (a re-prefill after preemption hitting its own old blocks is not the client's saving).
    usage_cached_tokens: int | None = None
    num_host_cached_tokens: int = 0    # of num_cached_tokens, those the host tier restored
    usage_host_cached_tokens: int = 0  # ... at first admission (usage, as above)
    queue_ms: float = 0.0              # arrival -> first scheduled step (usage)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[float] = field(default_factory=list)  # one per generated token if asked
    # Set by Scheduler.add, so the per-token finish checks are a set lookup and a compare:
    stop_ids: frozenset[int] = frozenset()  # ids that end it (stop_token_ids, eos unless ignored)
    len_limit: int = 0                      # it ends ("length") once it holds this many tokens
    arrival_time: float = 0.0   # time.monotonic() at the engine core; 0 once first scheduled
    order: int = 0              # arrival rank (Scheduler.add): a preempted seq keeps its place
    # Speculative decoding (scheduler_service/speculation.py): the tokens proposed for the
    # step in flight, the proposer's state, and whether the workers hold KV of rejected
    # proposals past num_computed_tokens (the next decode step tells them to rewind).
    proposal: list[int] = field(default_factory=list)
    spec: "SpecState | None" = None
    kv_stale: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)  # our own copy: we append to it
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def last_resolved_token(self) -> int:
        """The newest token whose id is known (skipping in-flight placeholders)."""
        return self.token_ids[-1 - self.num_pending_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold the KV of every token (the last one included)."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        """Token ids of logical block i (the last block may be partial)."""
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
