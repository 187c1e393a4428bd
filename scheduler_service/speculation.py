"""Speculative decoding, the engine core's half: who proposes what, and how many.

A proposal is a guess at a sequence's next tokens. The decode step that carries it (a
verify step: worker.proto's DecodeBatch.num_samples_i32) runs the guesses as extra decode
rows of the sequence, the same rows fast-forward's forced tokens use, and samples the
target's token after every row. `Scheduler.resolve` keeps the guesses that equal the sample
before them, then that sample: for a proposer that is a point mass (every one here) this
*is* the standard rejection rule (accept x with probability p(x); on rejection the sample
is drawn from p without x, renormalized), so greedy output is token-identical to no
speculation and a seeded request draws the same tokens (its noise is keyed by position).

Proposers:
* `draft` (or `eagle3`): a smaller model of the same tokenizer, or an EAGLE-3 head over the
  target's hidden states, on the workers (worker_service/drafter.py).
  A step asks the workers for k drafts per sequence (DecodeBatch.num_drafts_i32); they settle
  the step's proposals by the same rule, run the draft model k greedy steps from the newest
  token and return its ids with the step's answer: the next step's proposals. The scheduler
  reserves blocks for the draft's KV past the newest token (never preempting anyone for it);
* `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens (n from `ngram_max` down to `ngram_min`) in prompt + output;
* a request's `prediction` (OpenAI predicted outputs): the caller's expected answer; the
  proposer follows it while the output agrees and, after a disagreement, re-aligns where
  the output's last tokens occur in the prediction (a suffix match), taking the occurrence
  nearest to where an edit of the same length would have left it: in repetitive text the
  nearest, not the first, is where the answer goes on.

When: a proposal follows the sequence's newest token, and a verify step's next position
depends on what was accepted, so steps that propose wait for the step in flight to answer
(`Scheduler.wants_sync`): they give up the overlap of two steps in flight, a host round
trip per step. Measured (an H200, Qwen3-8B shapes) a sequence that sat out the step after
each of its verify steps instead cost a batch of 8 a sixth of its rows; waiting costs the
round trip only. That pays where a step reads all the weights for a token or two (small
batches), not in big ones: no proposals while more than `max_batch` sequences run, and
where a step finds nothing to propose the next ones run overlapped for a back-off that
doubles (to 16 steps) while tries keep finding nothing.

How many (k): proposal i of a sequence is sent only if its chance of acceptance (the
sequence's recent per-token acceptance to the power i) beats what the row costs: the
step's rows times the measured marginal cost of a row over the step's time (`StepCost`,
fitted to the decode steps' worker times).

Output formats and penalties apply to every verify row as to a plain sample: a constrained
sequence's proposal is cut where its format forbids it (`allowed`: the fast-forward
matchers), and the sampling rank masks each row with the grammar's state after the
proposals before it and counts them into the row's penalties (worker_service/grammar.py,
penalties.py), then takes in the run the scheduler accepts, by the same rule.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

# off: only requests' predictions are proposed; eagle3 is draft (the workers' --draft-model,
# a draft model or an EAGLE-3 head, decides what drafts)
METHODS = ("off", "ngram", "draft", "eagle3")


@dataclass
class SpecConfig:
    method: str = "off"       # one of METHODS
    num_tokens: int = 8       # most proposals per sequence and step (k)
    ngram_max: int = 4
    ngram_min: int = 2
    max_batch: int = 32       # no proposals while more sequences run
    adaptive: bool = True     # k from acceptance and row cost; False: always up to num_tokens

    def __post_init__(self) -> None:
        if self.method == "eagle3":
            self.method = "draft"
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: choose from "
                             f"{', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= 64:
            raise ValueError("num speculative tokens must be in [1, 64]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram min <= ngram max")


@dataclass
class SpecState:
    """One sequence's proposer state (lives on the Sequence; rebuilt lazily after restarts)."""
    corpus: array = field(default_factory=lambda: array("i"))   # ngram: prompt + known output
    prediction: array | None = None   # the request's prediction, packed for searching
    pred_pos: int | None = None   # prediction: index of the next token it expects
    anchor: int = 0               # prediction: where it last agreed,
    anchor_out: int = 0           # and the output's length then (re-alignment starts there)
    seen: int = 0                 # output tokens folded into pred_pos
    accepted: float = 0.0         # decayed counts of accepted proposals and of attempts
    attempts: float = 0.0         # (accepted + rejections): per-token acceptance = ratio
    num_proposed: int = 0         # totals for usage and metrics
    num_accepted: int = 0
    last_accepted: int = 0        # of the last verify step
    draft: list[int] = field(default_factory=list)   # draft: the workers' latest proposals,
    draft_at: int = -1            # made when the sequence held this many tokens
    draft_rest: int = 0           # steps drafted nothing since its acceptance stopped paying

    def acceptance(self, prior: float) -> float:
        return (self.accepted + 2 * prior) / (self.attempts + 2)

    def record(self, proposed: int, accepted: int) -> None:
        self.last_accepted = accepted
        self.accepted = 0.7 * self.accepted + accepted
        self.attempts = 0.7 * self.attempts + accepted + (accepted < proposed)
        self.num_proposed += proposed
        self.num_accepted += accepted


class StepCost:
    """Decode step time as a + b * rows, fitted to measured steps (worker time): per row
    count the fastest step seen, once seen MIN_SEEN times. Slow outliers are not the rows'
    cost: on an H100 a warm-up's lone 2-row step took twice a 1-row step; on CPU a row
    count's first steps pay for first-time work and flattened or inverted the line."""

    MIN_SEEN = 3

    def __init__(self, prior_ratio: float = 1 / 256):
        self.ms: dict[int, float] = {}   # rows -> fastest step ms
        self.seen: dict[int, int] = {}
        self.a, self.b = 1.0, prior_ratio

    def observe(self, rows: int, ms: float) -> None:
        if ms <= 0:
            return
        old = self.ms.get(rows)
        self.ms[rows] = ms if old is None else min(old, ms)
        n = self.seen[rows] = self.seen.get(rows, 0) + 1
        if n == self.MIN_SEEN or (n > self.MIN_SEEN and n % 16 == 0):
            self._fit()

    def _fit(self) -> None:
        xs = [r for r, n in self.seen.items() if n >= self.MIN_SEEN]
        ys = [self.ms[r] for r in xs]
        if len(xs) < 2:
            return
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var <= 0:
            return
        b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0)
        a = my - b * mx
        if a > 0:
            self.a, self.b = a, b

    def threshold(self, rows: int) -> float:
        """The acceptance chance a proposed row must beat in a step of `rows` rows: its
        cost over the step's cost per row."""
        return rows * self.b / (self.a + self.b * rows)


def _find(corpus: bytes, pattern: bytes, start: int, end: int, last: bool) -> int:
    """Token index of pattern (packed int32) in corpus[start:end) (token indices), first or
    last occurrence; -1 if none."""
    lo, hi = start * 4, end * 4
    while True:
        at = corpus.rfind(pattern, lo, hi) if last else corpus.find(pattern, lo, hi)
        if at < 0 or at % 4 == 0:
            return at // 4 if at >= 0 else -1
        if last:
            hi = at + len(pattern) - 1
        else:
            lo = at + 1


def ngram_proposal(corpus: array, k: int, n_max: int, n_min: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of corpus's last n tokens (n from
    n_max down): the latest with k tokens after it, else the latest (in a run of one
    repeated token the latest occurrence is one token back, with one token after it)."""
    size = len(corpus)
    raw = corpus.tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = raw[(size - n) * 4:]
        at = _find(raw, pattern, 0, size - k, last=True) if size - k >= n else -1
        if at < 0:
            at = _find(raw, pattern, 0, size - 1, last=True)
        if at >= 0:
            return corpus[at + n:at + n + k].tolist()
    return []


def follow_prediction(st: SpecState, prediction: array, output: list[int], n_max: int) -> None:
    """Fold output tokens not yet seen into st.pred_pos; re-align after a disagreement."""
    if st.seen > len(output):   # the output was cut back (restart): start over
        st.seen, st.pred_pos, st.anchor, st.anchor_out = 0, None, 0, 0
    if not st.seen and st.pred_pos is None:
        st.pred_pos = 0
    for i in range(st.seen, len(output)):
        p = st.pred_pos
        if p is not None and p < len(prediction) and prediction[p] == output[i]:
            st.pred_pos = st.anchor = p + 1
            st.anchor_out = i + 1
        else:
            st.pred_pos = None
    st.seen = len(output)
    if st.pred_pos is None and output:
        st.pred_pos = realign(prediction, output, n_max, st.anchor,
                              st.anchor + len(output) - st.anchor_out)


def realign(prediction: array, output: list[int], n_max: int, anchor: int, expected: int
            ) -> int | None:
    """Where in the prediction the output goes on: after the occurrence of the output's last
    n tokens (the longest n that occurs) that ends nearest `expected`, the place the output
    would have reached had the disagreement replaced as many tokens as it took (an edit of
    the same length), and past `anchor`, where the output left the prediction (what
    follows an occurrence ending there was just refused). None where no such occurrence is."""
    raw = prediction.tobytes()
    size = len(prediction)
    expected = min(max(expected, anchor + 1), size)
    tail = array("i", output[-n_max:])
    for n in range(len(tail), 0, -1):
        pattern = tail[len(tail) - n:].tobytes()
        lo = max(anchor + 1 - n, 0)   # occurrences ending past the anchor
        after = _find(raw, pattern, max(expected + 1 - n, lo), size, last=False)
        before = _find(raw, pattern, lo, expected, last=True)
        ends = [at + n for at in (after, before) if at >= 0]
        if ends:
            return min(ends, key=lambda end: abs(end - expected))
    return None


class Speculator:
    """Proposals for the scheduler's decode steps (one per engine core)."""

    PRIOR = {"prediction": 0.8, "ngram": 0.5, "draft": 0.7}   # acceptance before a sequence has any
    MAX_BACKOFF = 16   # overlapped steps between tries, at most

    def __init__(self, config: SpecConfig, allowed=None):
        self.config = config
        # allowed(seq, tokens) -> how many of the proposed tokens seq's output format allows
        # (FastForward.allowed); None: constrained sequences get no proposals
        self.allowed = allowed
        self.cost = StepCost()
        self.backoff = 0   # decode steps to run overlapped before trying to propose again
        self.wait = 1      # the next back-off (doubles while tries find nothing)

    def active(self, num_running: int) -> bool:
        """Whether this step's sequences may get proposals."""
        return num_running <= self.config.max_batch and self.backoff <= 0

    def arrived(self) -> None:
        """A new request may bring a prediction or text that repeats: try again at once."""
        self.backoff, self.wait = 0, 1

    def tick(self) -> None:
        """A decode step ran overlapped."""
        self.backoff -= 1

    def proposed(self, any_proposal: bool) -> None:
        """A step that tried to propose: back off while nothing is found (unrelated
        predictions, text without repeats), so waiting for each step costs nothing then."""
        if any_proposal:
            self.wait = 1
        else:
            self.backoff, self.wait = self.wait, min(2 * self.wait, self.MAX_BACKOFF)

    def eligible(self, seq) -> bool:
        """Whether seq may get proposals: not where it asked for none or where its format
        could not be checked here. (Penalties: the sampling rank counts a row's proposed
        tokens before it into its penalties, worker_service/penalties.py.)"""
        s = seq.sampling
        return (s.speculate and (bool(s.prediction) or self.config.method != "off")
                and (not s.grammar or self.allowed is not None))

    def propose(self, seq, room: int, batch_rows: int) -> list[int]:
        """Up to `room` tokens to verify after seq's newest (known) token; [] to decode it
        plainly."""
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState()
        cfg = self.config
        source = "prediction" if seq.sampling.prediction else cfg.method
        k = self._count(st, source, room, batch_rows)
        proposal: list[int] = []
        if k:
            ids = seq.token_ids
            if source == "draft":
                if st.draft_at == len(ids):
                    proposal = st.draft[:k]
            elif source == "prediction":
                if st.prediction is None:
                    st.prediction = array("i", seq.sampling.prediction)
                pred = st.prediction
                follow_prediction(st, pred, ids[seq.num_prompt_tokens:], cfg.ngram_max)
                if st.pred_pos is not None:
                    proposal = pred[st.pred_pos:st.pred_pos + k].tolist()
            else:
                st.corpus.extend(ids[len(st.corpus):])
                proposal = ngram_proposal(st.corpus, k, cfg.ngram_max, cfg.ngram_min)
        if proposal and seq.sampling.grammar:   # what the format forbids is never sent
            del proposal[self.allowed(seq, proposal):]
        return proposal

    def _count(self, st: SpecState, source: str, room: int, batch_rows: int) -> int:
        """k: proposals while the chance that all are accepted beats a row's cost."""
        cfg = self.config
        a = st.acceptance(self.PRIOR[source])
        threshold = self.cost.threshold(batch_rows) if cfg.adaptive else 0.0
        k, chance = 0, a
        while k < min(cfg.num_tokens, room) and chance > threshold:
            k += 1
            chance *= a
        return k

    def num_drafts(self, seq, room: int, batch_rows: int) -> int:
        """How many tokens the workers' draft model should propose for seq after this step
        (0: none): as many as the next step would verify. Where its recent acceptance does
        not pay for even one, none, but one every MAX_BACKOFF steps: acceptance is measured
        only on proposals (a drafter that is always wrong costs a draft pass and a host
        round trip a step; with nothing asked the steps run overlapped again)."""
        if self.config.method != "draft" or seq.sampling.prediction or room <= 0:
            return 0
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState()
        k = self._count(st, "draft", room, batch_rows)
        if k:
            st.draft_rest = 0
            return k
        st.draft_rest += 1
        if st.draft_rest >= self.MAX_BACKOFF:
            st.draft_rest = 0
            return 1
        return 0

    @staticmethod
    def take_drafts(seq, drafts: list[int]) -> None:
        """The workers' proposals for seq, drafted after its newest (now known) token."""
        st = seq.spec
        if st is not None:
            st.draft = [t for t in drafts if t >= 0]
            st.draft_at = len(seq.token_ids)


def spec_usage(seq) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens of a finished seq (OpenAI's usage counts;
    zeros where the request sent no prediction)."""
    st = seq.spec
    if st is None or not seq.sampling.prediction:
        return 0, 0
    return st.num_accepted, st.num_proposed - st.num_accepted
