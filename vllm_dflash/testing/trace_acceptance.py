# SPDX-License-Identifier: Apache-2.0
"""What the engine accepted at each DFlash step, read from ``VLLM_DFLASH_TRACE``.

A trace record's ``num_tokens`` is the committed length when the draft was
made; the request's next record has ``num_tokens + accepted + 1``, so the
engine's acceptance per step follows from consecutive records (a request's
last record is left out: that draft is never verified, nor is a step whose
accepted tokens run past the output's end, where ``max_tokens`` cut them).

Greedy verification accepts exactly the longest prefix of the draft that
equals the target's own continuation (``expected``: the run's output, or the
no-speculation output where given) *of the draft tokens the scheduler put in
the step*. The scheduler may schedule fewer than k draft tokens when the step's
token budget is short (chunked prefills of other requests), and vLLM counts
only the scheduled ones (``vllm:spec_decode_num_draft_tokens``). So a correct
engine never accepts more than ``expected`` in a step, and its total shortfall
is at most the number of draft tokens it left unscheduled.
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

    def over_accepted(self) -> list[StepAcceptance]:
        """Steps that accepted a draft token greedy verification must reject."""
        return [s for s in self.steps if s.accepted > s.expected]

    @property
    def shortfall(self) -> int:
        """Draft tokens greedy verification would accept but the engine did not."""
        return sum(max(s.expected - s.accepted, 0) for s in self.steps)


def unscheduled_draft_tokens(counters: dict[str, float], k: int) -> int:
    """Draft tokens the scheduler left out of their steps (engine counters)."""
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    return round(drafts * k - counters.get("vllm:spec_decode_num_draft_tokens", 0.0))


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


def step_acceptance(
    run: dict, trace: list[dict], truth: list[list[int]] | None = None
) -> AcceptanceStats:
    """Per-step acceptance of ``trace`` (records of ``run``: offline_run.py's
    JSON, with ``request_ids``, ``prompts`` and ``outputs``); ``truth``: the
    outputs greedy verification must reproduce (default: the run's own)."""
    rids = list(run["request_ids"])
    outputs = run["outputs"] if truth is None else truth
    by_request: dict[int, list[dict]] = {}
    for rec in trace:
        by_request.setdefault(_owner(rids, rec["request_id"]), []).append(rec)
    stats = AcceptanceStats()
    for i, recs in sorted(by_request.items()):
        seq = run["prompts"][i] + outputs[i]
        recs = sorted(recs, key=lambda r: r["num_tokens"])
        for rec, nxt in zip(recs, recs[1:], strict=False):
            n, draft = rec["num_tokens"], rec["draft_token_ids"]
            if nxt["num_tokens"] > len(seq):
                continue  # accepted tokens past max_tokens: cut from the output
            stats.steps.append(
                StepAcceptance(
                    request_id=rids[i],
                    num_tokens=n,
                    accepted=nxt["num_tokens"] - n - 1,
                    expected=_matching_prefix(draft, seq[n : n + len(draft)]),
                )
            )
    return stats
