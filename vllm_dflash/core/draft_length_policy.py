# SPDX-License-Identifier: Apache-2.0
"""How many of the k draft tokens to verify in the next step (pure Python).

DFlash drafts a whole block of k tokens per request per step. Verifying them is
free while the target's step is weight-bandwidth bound (small batches); once the
batch makes the verify compute bound, each rejected draft token costs real time
and a fixed k can be slower than no speculation. The policy picks one draft
length ``d`` (0..k) per step for the whole batch, from what the engine measured:

* acceptance per draft position: ``p_j = P(draft j accepted | drafts 1..j-1
  accepted)``, counted from every verified step (decayed, so it follows the
  traffic); the expected tokens per request of a step with ``d`` drafts are
  ``E(d) = 1 + sum_{j<=d} prod_{i<=j} p_i``;
* step time per batch-size bucket (number of running requests, powers of two) and
  per candidate ``d``, from the wall time between step outputs (no device sync);

and chooses the candidate with the highest ``E(d) / step_time(d)``: tokens per
second per request. Candidates are tried by hill climbing from the best length of
the nearest bucket already measured (from ``k`` at start-up): a neighbouring
candidate is probed for a few steps, and so is the next one beyond it while they
are not clearly worse than the best (by ``margin``: step times are noisy); the
policy moves to the best measured length when it beats the current one by more
than ``margin`` (a tie keeps the current length), and
every ``reprobe_every`` measured steps the other lengths are measured again the
same way (context lengths grow, the traffic changes). Step times are medians of
the last few samples, so a slow outlier (a kernel compiled on first use) does
not decide the length, and they are fitted non-decreasing in ``d`` (a step that
verifies more tokens cannot be cheaper; weighted pool-adjacent-violators): on
the H200 a few noisy medians made 15 drafts look cheaper than 8 at 64 requests
and the policy wandered between 4, 6 and 15 (H200, 2026-12-02, 2988acc).
The one exception is ``k`` in a bucket whose batches all run as the target's full
CUDA graph (vLLM captures full graphs only for uniform batches of ``1 + k``
tokens per request, up to ``full_graph_tokens`` tokens): there ``k`` is really
cheaper than shorter lengths (H200, one request: 7.1 ms for 15 drafts, 8.1-12.9
ms for 2-11; H200, 2026-12-02, 494805a), so it keeps its own median and only the
shorter lengths are fitted, and a bucket whose batches get no full graph does not
start from a neighbour's k that won by its graph (it starts from that
neighbour's best shorter length).
Of lengths that score within 1% of the best (with fitted times, a block of
lengths that cost the same differs only by the acceptance of its last positions),
the shortest is taken. For the same reason a longer length whose expected tokens
exceed the current one's by no more than 1% is never probed (it costs no less, so
it cannot win; k with a full CUDA graph excepted), and a new bucket starts at the
acceptance knee below the neighbour's length: the shortest length whose expected
tokens are within 1% of it (H200, acceptance 3.5, 64 requests: the first batch
probed 8, 11 and 15 drafts, whose positions 4-15 are never accepted, at 29-31 ms a
step where 3 drafts took 10 ms; ``benchmarks/results/h200-2026-12-02-5ec9de5``). A walk stops at a
clearly worse length, except at 1 draft (both ways) wherever k gets no full CUDA
graph: a step with 0 drafts skips the drafter's query pass, so its time is not on
the line of the longer lengths (H200, 27B hybrid pair, 256 requests, acceptance
3.5: the walk down stopped at 1, never measured 0, and 2 drafts ran at 0.96x no
speculation; H200, 2026-12-03, 31db657).

The scheduler asks :meth:`choose` once per step and reports each finished step
with :meth:`observe_step` and :meth:`observe_acceptance`; nothing here touches
vLLM or the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def default_candidates(k: int) -> tuple[int, ...]:
    """Draft lengths the policy may pick: dense near 0, sparser up to ``k``."""
    base = (0, 1, 2, 3, 4, 6, 8, 11, 15, 23, 31)
    return tuple(sorted({d for d in base if d < k} | {k}))


def bucket_of(num_reqs: int) -> int:
    """Batch-size bucket: 1, 2-3, 4-7, ... share a bucket."""
    return max(1, num_reqs).bit_length()


TIE = 0.01  # scores this close to the best: the shortest such length wins


def _shortest_near_best(scores: list[float | None]) -> int | None:
    """Index of the shortest length scoring within TIE of the best; None if
    nothing is measured."""
    measured = [s for s in scores if s is not None]
    if not measured:
        return None
    best = max(measured)
    return next(
        i for i, s in enumerate(scores) if s is not None and s >= best * (1 - TIE)
    )


def monotone_fit(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least
    squares (pool adjacent violators): step times in order of draft length."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, float(max(w, 1)), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


@dataclass
class _Cost:
    """One candidate's step time in one bucket: the median of its last few
    samples (a step that compiled a kernel or met a host hiccup is one slow
    sample, and must not decide the length for hundreds of steps)."""

    recent: list[float] = field(default_factory=list)
    samples: int = 0

    WINDOW = 5

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        del self.recent[: -self.WINDOW]
        self.samples += 1

    @property
    def seconds(self) -> float:
        s = sorted(self.recent)
        return s[len(s) // 2] if s else 0.0


@dataclass
class _Bucket:
    costs: dict[int, _Cost] = field(default_factory=dict)
    current: int = -1  # index into candidates; -1 until the first choice
    probing: int | None = None  # index being probed, if any
    steps: int = 0  # measured steps in this bucket
    last_reprobe: int = 0
    # k may run as the target's full CUDA graph here: not fitted with the others
    graph_k: bool = False


class DraftLengthPolicy:
    def __init__(
        self,
        k: int,
        candidates: tuple[int, ...] | None = None,
        probe_samples: int = 3,
        margin: float = 0.03,
        reprobe_every: int = 512,
        acceptance_decay: float = 0.995,
        full_graph_tokens: int = 0,
        max_num_reqs: int | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k
        self.candidates = candidates or default_candidates(k)
        if self.candidates[-1] != k or self.candidates[0] < 0:
            raise ValueError(
                f"candidates {self.candidates} must lie in 0..{k}, end at k"
            )
        self.probe_samples = probe_samples
        self.margin = margin
        self.reprobe_every = reprobe_every
        self.acceptance_decay = acceptance_decay
        # largest batch (tokens) that runs as the target's full CUDA graph when
        # every request verifies k drafts; 0: no full graphs
        self.full_graph_tokens = full_graph_tokens
        # the engine's max_num_seqs: a bucket's batches are never larger (so the
        # top bucket runs k as a full graph where max_num_seqs x (1 + k) fits,
        # e.g. k = 7, 64 requests, 512 tokens)
        self.max_num_reqs = max_num_reqs
        # tried[j] / accepted[j]: requests whose step verified draft j+1 (1-based
        # position j+1), and those of them that accepted it. Prior: one in two.
        self.tried = np.full(k, 2.0)
        self.accepted = np.full(k, 1.0)
        self.buckets: dict[int, _Bucket] = {}

    # -- acceptance ---------------------------------------------------------
    def observe_acceptance(
        self, num_drafts: np.ndarray, num_accepted: np.ndarray
    ) -> None:
        """One verified step: per request, drafts verified and drafts accepted.

        A position past the first rejection is never verified and tells nothing.
        Older steps are decayed first, so the rates follow the traffic."""
        f = self.acceptance_decay
        self.tried = 2.0 + (self.tried - 2.0) * f
        self.accepted = 1.0 + (self.accepted - 1.0) * f
        verified = np.minimum(num_drafts, num_accepted + 1)
        k = self.k
        # requests that verified position j (0-based): verified > j
        self.tried += np.bincount(np.clip(verified, 0, k), minlength=k + 1)[
            ::-1
        ].cumsum()[::-1][1:]
        self.accepted += np.bincount(np.clip(num_accepted, 0, k), minlength=k + 1)[
            ::-1
        ].cumsum()[::-1][1:]

    def conditional_rates(self) -> np.ndarray:
        return self.accepted / self.tried

    def _expected(self) -> np.ndarray:
        """E(0..k): entry d is the tokens one request commits in a step that
        verifies ``d`` drafts."""
        return np.concatenate(
            ([1.0], 1.0 + np.cumprod(self.conditional_rates()).cumsum())
        )

    def expected_tokens(self, d: int) -> float:
        """E(d): tokens one request commits in a step that verifies ``d`` drafts."""
        return float(self._expected()[d])

    # -- choice -------------------------------------------------------------
    def _scores(self, bucket: _Bucket) -> list[float | None]:
        """Per candidate: ``E(d) / step_time(d)``, or None while it has fewer than
        ``probe_samples`` samples. The measured times are fitted non-decreasing
        in ``d`` first (:func:`monotone_fit`)."""
        measured = [
            (i, cost)
            for i, d in enumerate(self.candidates)
            if (cost := bucket.costs.get(d)) is not None
            and cost.samples >= self.probe_samples
            and cost.seconds > 0
        ]
        # k with a full CUDA graph keeps its own time (module docstring)
        own = [m for m in measured if bucket.graph_k and m[0] == self._k_index]
        measured = [m for m in measured if m not in own]
        fitted = monotone_fit(
            [c.seconds for _, c in measured], [len(c.recent) for _, c in measured]
        )
        measured += own
        fitted += [c.seconds for _, c in own]
        gains = self._expected()
        scores: list[float | None] = [None] * len(self.candidates)
        for (i, _), t in zip(measured, fitted, strict=True):
            scores[i] = float(gains[self.candidates[i]]) / t
        return scores

    def _bucket(self, b: int) -> _Bucket:
        bucket = self.buckets.get(b)
        if bucket is None:
            largest = (1 << b) - 1  # bucket b: batches of 2**(b-1) .. 2**b - 1
            if self.max_num_reqs:
                largest = min(largest, self.max_num_reqs)
            # every batch of the bucket runs k as a full graph (a bucket where
            # only its smallest batches do is fitted as before)
            graph_k = largest * (1 + self.k) <= self.full_graph_tokens
            bucket = self.buckets[b] = _Bucket(graph_k=graph_k)
        return bucket

    def _start_index(self, b: int) -> int:
        """Best measured index of the nearest bucket with data, else k's."""
        known = [
            (abs(other - b), other)
            for other, bk in self.buckets.items()
            if other != b and bk.current >= 0 and self._scores(bk)[bk.current]
        ]
        if not known:
            return self._k_index
        near = self.buckets[min(known)[1]]
        start = near.current
        if start == self._k_index and near.graph_k:
            if self.buckets[b].graph_k:
                return start
            # k won there by its full CUDA graph, which batches here do not get:
            # start from the best shorter length measured there, if any
            shorter = _shortest_near_best(self._scores(near)[: self._k_index])
            if shorter is not None:
                start = shorter
        return self._knee(start)

    def _knee(self, i: int) -> int:
        """The shortest candidate at or below index ``i`` whose expected tokens
        are within TIE of ``i``'s (module docstring). Its step costs no more
        (fitted non-decreasing in ``d``), so it scores within TIE of ``i`` or
        better."""
        gains = self._expected()
        floor = gains[self.candidates[i]] / (1.0 + TIE)
        return next(j for j in range(i + 1) if gains[self.candidates[j]] >= floor)

    def _gains_over(self, bucket: _Bucket, gains: np.ndarray, i: int, j: int) -> bool:
        """Whether a longer candidate ``j`` can beat ``i``: its expected tokens
        (``gains``: :meth:`_expected`) exceed ``i``'s by more than TIE (else,
        costing no less, it scores within TIE of ``i`` at best and the shorter
        ``i`` is kept), or it is k and runs as a full CUDA graph."""
        if j == self._k_index and bucket.graph_k:
            return True
        return gains[self.candidates[j]] > gains[self.candidates[i]] * (1.0 + TIE)

    @property
    def _k_index(self) -> int:
        return len(self.candidates) - 1

    def _next_probe(self, bucket: _Bucket, scores: list[float | None]) -> int | None:
        """An unmeasured candidate worth a probe: walking away from the current
        length in each direction, past every candidate not clearly worse than the
        best measured (a flat stretch may hide a better length behind it)."""
        cur = bucket.current
        best = max(s for s in scores if s is not None)
        gains = self._expected()
        for step in (-1, 1):
            i = cur + step
            while 0 <= i < len(self.candidates):
                if scores[i] is None:
                    # a longer length whose extra drafts are (almost) never
                    # accepted cannot win: not worth a probe
                    if step < 0 or self._gains_over(bucket, gains, cur, i):
                        return i
                elif scores[i] < best * (1.0 - self.margin) and not self._walks_past(
                    bucket, i
                ):
                    break
                i += step
        return None

    def _walks_past(self, bucket: _Bucket, i: int) -> bool:
        """Whether the walk goes on past candidate ``i`` although it is clearly
        worse than the best: past the shortest length above 0, both ways, where k
        gets no full CUDA graph (module docstring). 0's time is not on the line
        through the longer lengths' (no drafter query pass), so 1 being clearly
        worse than 2 says nothing about 0, nor than 0 about 2: down, 0 gets
        measured; up from 0, a re-probe still finds 2. Batches where k runs as a
        full graph are weight-bandwidth bound: there a 0-draft probe could only
        cost."""
        return i == 1 and self.candidates[0] == 0 and not bucket.graph_k

    def choose(self, num_reqs: int) -> int:
        """The draft length to schedule now for a batch of ``num_reqs`` requests."""
        b = bucket_of(num_reqs)
        bucket = self._bucket(b)
        if bucket.current < 0:
            bucket.current = self._start_index(b)
        if bucket.probing is not None:
            cost = bucket.costs.get(self.candidates[bucket.probing])
            if cost is None or cost.samples < self.probe_samples:
                return self.candidates[bucket.probing]
            bucket.probing = None
        cur = bucket.current
        scores = self._scores(bucket)
        here = scores[cur]
        if here is None:
            return self.candidates[cur]
        if bucket.steps - bucket.last_reprobe >= self.reprobe_every:
            # measure again: every other length (climbing from the current one,
            # so only those not clearly worse), and the current one as it is now
            bucket.last_reprobe = bucket.steps
            keep = self.candidates[cur]
            bucket.costs = {keep: bucket.costs[keep]}
            scores = self._scores(bucket)
        probe = self._next_probe(bucket, scores)
        if probe is not None:
            bucket.probing = probe
            return self.candidates[probe]
        # every candidate worth measuring is measured: the shortest length
        # within TIE of the best score; move there if clearly better
        i = _shortest_near_best(scores)
        if scores[i] > here * (1.0 + self.margin):
            bucket.current = i
        return self.candidates[bucket.current]

    def observe_step(self, num_reqs: int, d: int, seconds: float) -> None:
        """A finished step of ``num_reqs`` decoding requests that verified ``d``
        drafts each took ``seconds`` (wall time, output to output)."""
        if d not in self.candidates or seconds <= 0:
            return
        bucket = self._bucket(bucket_of(num_reqs))
        bucket.steps += 1
        cost = bucket.costs.setdefault(d, _Cost())
        cost.add(seconds)

    def describe(self) -> dict:
        """For logs and tests: per bucket, chosen length and measured costs."""
        return {
            "rates": [round(float(p), 3) for p in self.conditional_rates()],
            "buckets": {
                b: {
                    "current": self.candidates[bk.current] if bk.current >= 0 else None,
                    "ms": {
                        d: round(c.seconds * 1e3, 3)
                        for d, c in sorted(bk.costs.items())
                        if c.samples
                    },
                }
                for b, bk in sorted(self.buckets.items())
            },
        }
