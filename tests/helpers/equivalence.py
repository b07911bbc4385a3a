# SPDX-License-Identifier: Apache-2.0
"""Compare traced vLLM drafts with the float64 reference on the same sequences."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.reference import Reference


@dataclass
class MatchStats:
    drafts: int
    tokens: int
    equal_tokens: int
    equal_drafts: int
    near_ties: int = 0  # unequal tokens the float64 drafter scores as near-ties

    @property
    def token_rate(self) -> float:
        return self.equal_tokens / max(self.tokens, 1)

    @property
    def rate_excusing_near_ties(self) -> float:
        return (self.equal_tokens + self.near_ties) / max(self.tokens, 1)


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def sequences_by_request(run: dict) -> dict[str, list[int]]:
    return {
        rid: p + o
        for rid, p, o in zip(
            run["request_ids"], run["prompts"], run["outputs"], strict=True
        )
    }


def _lookup(seqs: dict[str, list[int]], worker_rid: str) -> list[int]:
    if worker_rid in seqs:
        return seqs[worker_rid]
    # vLLM may append a suffix to the user's request id inside the engine.
    hits = [s for rid, s in seqs.items() if worker_rid.startswith(rid + "-")]
    assert len(hits) == 1, f"cannot map traced request {worker_rid!r}"
    return hits[0]


UNSEEN = -1  # a token the trace could not read (async scheduling's placeholder)


def aligned(seq: list[int], last_token_ids: list[int]) -> bool:
    """Whether a record's last tokens end ``seq``. The newest token (last) must be
    known; an earlier one the trace could not see (``UNSEEN``: with asynchronous
    scheduling the runner's host token table holds placeholders for tokens the
    trace's own history missed) matches anything."""
    tail = seq[-len(last_token_ids) :]
    return (
        len(tail) == len(last_token_ids)
        and last_token_ids[-1] != UNSEEN
        and all(
            t == u or u == UNSEEN for t, u in zip(tail, last_token_ids, strict=True)
        )
    )


def compare(
    ref: Reference, run: dict, trace: list[dict], near_tie: float = 0.0
) -> MatchStats:
    """Replay every traced draft on the reference. A misaligned record (its last
    tokens are not the run's sequence) fails loudly. With ``near_tie`` > 0, an
    unequal token whose float64 logit gap is below ``near_tie`` x the logit
    range counts in ``near_ties``."""
    seqs = sequences_by_request(run)
    # image specs per request (image prompts; see tests/helpers/images.py)
    images = dict(zip(run["request_ids"], run.get("images") or [], strict=False))
    feats_cache: dict[int, object] = {}
    stats = MatchStats(0, 0, 0, 0)
    for rec in trace:
        full = _lookup(seqs, rec["request_id"])
        n = rec["num_tokens"]
        if n > len(full):
            continue  # drafted past the end of generation (never verified)
        seq = full[:n]
        assert aligned(seq, rec["last_token_ids"]), (
            f"trace misaligned for {rec['request_id']} at {n}"
        )
        key = id(full)
        if key not in feats_cache:
            # causal: prefixes reuse it
            feats_cache[key] = ref.features(
                full, _lookup(images, rec["request_id"]) if images else None
            )
        k = len(rec["draft_token_ids"])
        # the first k positions of the drafter's block (a partial draft head)
        want, logits = ref.draft(
            seq, rec.get("block", k), feats=feats_cache[key][: n - 1]
        )
        want, logits = want[:k], logits[:k]
        eq = sum(int(a == b) for a, b in zip(want, rec["draft_token_ids"], strict=True))
        if near_tie > 0:
            for j, (a, b) in enumerate(zip(want, rec["draft_token_ids"], strict=True)):
                gap = float(logits[j][a] - logits[j][b])
                span = float(logits[j].max() - logits[j].min())
                stats.near_ties += int(a != b and gap <= near_tie * span)
        stats.drafts += 1
        stats.tokens += k
        stats.equal_tokens += eq
        stats.equal_drafts += int(eq == k)
    return stats


def greedy_divergences(
    ref: Reference, prompts: list[list[int]], outputs: list[list[int]]
) -> list[dict]:
    """Where ``outputs`` leave the float64 target's own greedy continuation.

    One entry per diverging sequence: position, the two tokens and their float64
    logit gap relative to the logit range (a near-tie if small). The float32 CPU
    backend without speculation reproduces float64 greedy exactly on the tiny
    fixtures (measured: 8/8 sequences x 32 tokens), so this stands in for a
    no-speculation run where an engine start is too costly (matrix smoke)."""
    import torch

    rows = []
    with torch.no_grad():
        for n, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            logits = ref.target(torch.tensor([prompt + out])).logits[0]
            want = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
            bad = [i for i, (a, b) in enumerate(zip(want, out, strict=True)) if a != b]
            if bad:
                i, row = bad[0], logits[len(prompt) - 1 + bad[0]]
                gap = float(row[want[i]] - row[out[i]]) / float(row.max() - row.min())
                rows.append({"sequence": n, "position": i, "float64": want[i],
                             "vllm": out[i], "gap_rel_range": gap})  # fmt: skip
    return rows
