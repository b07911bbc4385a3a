# SPDX-License-Identifier: Apache-2.0
"""What the engine accepted at each DFlash step, read from ``VLLM_DFLASH_TRACE``.

A trace record's ``num_tokens`` is the committed length when the draft was
made; the request's next record has ``num_tokens + accepted + 1``, so the
engine's acceptance per step follows from consecutive records (a request's
last record is left out: its step may have been cut by ``max_tokens``). Greedy
verification accepts exactly the longest prefix of the draft that equals the
target's own continuation, which for a lossless run is the run's output, so
the two can be compared step by step: a verify path that rejects a good draft
or accepts a bad one shows up here even where the output stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepAcceptance:
    request_id: str
    num_tokens: int  # committed length when drafted (the block's anchor included)
    accepted: int  # draft tokens the engine accepted (from the next record)
    expected: int  # longest draft prefix equal to the run's output


@dataclass
class AcceptanceStats:
    steps: list[StepAcceptance] = field(default_factory=list)

    @property
    def mean_length(self) -> float:
        """Mean tokens per step (accepted + 1), as vLLM's acceptance length."""
        return sum(s.accepted + 1 for s in self.steps) / max(len(self.steps), 1)

    def count(self, at_least: int) -> int:
        return sum(s.accepted >= at_least for s in self.steps)

    def mismatches(self) -> list[StepAcceptance]:
        return [s for s in self.steps if s.accepted != s.expected]


def _owner(request_ids: list[str], traced: str) -> int:
    if traced in request_ids:
        return request_ids.index(traced)
    hits = [i for i, r in enumerate(request_ids) if traced.startswith(r + "-")]
    assert len(hits) == 1, f"cannot map traced request {traced!r}"
    return hits[0]


def _matching_prefix(draft: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(draft, truth, strict=False):
        if a != b:
            break
        n += 1
    return n


def step_acceptance(run: dict, trace: list[dict]) -> AcceptanceStats:
    """Per-step acceptance of ``trace`` (records of ``run``: offline_run.py's
    JSON, with ``request_ids``, ``prompts`` and ``outputs``)."""
    rids = list(run["request_ids"])
    by_request: dict[int, list[dict]] = {}
    for rec in trace:
        by_request.setdefault(_owner(rids, rec["request_id"]), []).append(rec)
    stats = AcceptanceStats()
    for i, recs in sorted(by_request.items()):
        seq = run["prompts"][i] + run["outputs"][i]
        recs = sorted(recs, key=lambda r: r["num_tokens"])
        for rec, nxt in zip(recs, recs[1:], strict=False):
            n, draft = rec["num_tokens"], rec["draft_token_ids"]
            stats.steps.append(
                StepAcceptance(
                    request_id=rids[i],
                    num_tokens=n,
                    accepted=nxt["num_tokens"] - n - 1,
                    expected=_matching_prefix(draft, seq[n : n + len(draft)]),
                )
            )
    return stats
