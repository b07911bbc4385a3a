# SPDX-License-Identifier: Apache-2.0
"""``VLLM_DFLASH_TRACE``: one JSON line per request per DFlash drafting step.

Record: ``{"request_id", "num_tokens", "last_token_ids", "draft_token_ids",
"block"}``, where ``num_tokens`` is the length of the committed sequence
including the newest token (the one that opens the draft block),
``last_token_ids`` its last min(4, num_tokens) tokens, ``block`` the drafter's
query block (k, or d for a short block: ``spec_decode/short_draft_block.py``) and
``draft_token_ids`` the proposed tokens: all of the block's, or the first ones
the draft head computed (``spec_decode/partial_draft_head.py``).

The hook is installed only when the variable is set, so it costs nothing
otherwise; when set it copies a few small tensors to the host once per step (a
debugging aid). Tokens are read from the drafting step's own inputs (the
step's context tokens and the newest token), which is right with asynchronous
scheduling too (see TokenHistory).
"""

from __future__ import annotations

import json
import os
import threading

import torch

from vllm_dflash import envs
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    PatchState,
    original,
    replace_attr,
)

NAME = "dflash_trace"
_RUNNER = "_vllm_dflash_runner"
_HISTORY = "_vllm_dflash_history"
_lock = threading.Lock()


class TraceWriter:
    """Appends records; the first write of an engine's writer starts the file
    afresh, so records of an earlier run never mix with this one's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mode = "w"

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        blob = "".join(json.dumps(r) + "\n" for r in records)
        with _lock, open(self.path, self._mode, encoding="utf-8") as fh:
            fh.write(blob)
            self._mode = "a"


class TokenHistory:
    """The last few committed tokens of each request, from drafting-step inputs.

    Every committed token is a valid context token of some drafting step (prompt
    chunks, then each step's previous newest token and accepted drafts) and every
    generated one is first some step's newest (sampled) token, so this stays
    right with asynchronous scheduling, where the runner's host token table lags
    behind the device (it holds -1 for tokens still on the device). Prompt
    tokens it never saw (prefix-cache hits) come from that table, which always
    holds the prompt.
    """

    KEEP = 8

    def __init__(self) -> None:
        self._by_req: dict[str, dict[int, int]] = {}

    def add(self, req_id: str, positions: list[int], tokens: list[int]) -> None:
        hist = self._by_req.setdefault(req_id, {})
        # A negative id is a placeholder (an asynchronous step's token not yet
        # known where it was read): never let it replace a known token.
        hist.update(
            (p, t)
            for p, t in zip(positions[-self.KEEP :], tokens[-self.KEEP :], strict=True)
            if t >= 0
        )
        if len(hist) > 2 * self.KEEP:
            for p in sorted(hist)[: -self.KEEP]:
                del hist[p]

    def get(self, req_id: str, pos: int, fallback) -> int:
        tok = self._by_req.get(req_id, {}).get(pos)
        return int(fallback(pos)) if tok is None else tok

    def retain(self, live: set[str], limit: int) -> None:
        if len(self._by_req) > limit:
            for rid in [r for r in self._by_req if r not in live]:
                del self._by_req[rid]


def collect_records(
    runner,
    history: TokenHistory,
    target_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    next_token_ids: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    num_rejected: torch.Tensor | None,
    drafts: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
) -> list[dict]:
    batch = drafts.shape[0]
    tokens = target_token_ids.tolist()
    if target_positions.dim() == 2 and seq_lens is not None:
        # M-RoPE (3, N): after an image no row is the token index; records and
        # the history count tokens, computed like dflash_mrope_token_positions.
        from vllm_dflash.spec_decode.mrope_positions import token_positions

        qsl_t = query_start_loc_cpu[: batch + 1]
        positions = token_positions(
            qsl_t, seq_lens[:batch].cpu(), int(qsl_t[-1])
        ).tolist()
    else:
        positions = target_positions.reshape(-1, target_positions.shape[-1])[0].tolist()
    qsl = query_start_loc_cpu[: batch + 1].tolist()
    rejected = (
        num_rejected[:batch].tolist() if num_rejected is not None else [0] * batch
    )
    newest = next_token_ids[:batch].tolist()
    drafts_l = drafts.tolist()
    req_ids = runner.input_batch.req_ids[:batch]
    discard = runner.discard_request_mask.np[:batch].tolist()
    table = runner.input_batch.token_ids_cpu
    records = []
    for i in range(batch):
        start, end = qsl[i], qsl[i + 1] - rejected[i]
        if end <= start:
            continue
        history.add(req_ids[i], positions[start:end], tokens[start:end])
        if discard[i]:
            continue  # partial prefill: the draft is thrown away
        n = positions[end - 1] + 2  # the newest token sits right after the context
        # The newest token is the sampled one, exact on every path: it is the
        # next step's first context token, which the history then already has.
        history.add(req_ids[i], [n - 1], [int(newest[i])])
        prev = [
            history.get(req_ids[i], p, lambda p, i=i: table[i, p])
            for p in range(max(0, n - 4), n - 1)
        ]
        records.append(
            {
                "request_id": req_ids[i],
                "num_tokens": n,
                "last_token_ids": prev + [int(newest[i])],
                "draft_token_ids": [int(t) for t in drafts_l[i]],
            }
        )
    history.retain(set(req_ids), limit=4 * max(batch, 64))
    return records


def probe() -> bool:
    return envs.trace_path() is not None


def apply() -> None:
    import inspect

    from vllm.distributed import parallel_state
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from vllm_dflash.spec_decode.context_only_pass import next_drafts
    from vllm_dflash.spec_decode.partial_draft_head import head_positions
    from vllm_dflash.spec_decode.short_draft_block import query_block

    writer = TraceWriter(os.path.abspath(envs.trace_path()))
    stock_init = original(DFlashProposer.__init__)
    # wraps what is there (dflash_short_draft_block over dflash_context_only_pass,
    # which decides whether the drafter drafts: all three are applied on import
    # of the model runner, in catalog order, tests/unit/test_patch_chains.py);
    # the arguments are bound by vLLM's signature
    stock_propose = DFlashProposer.propose
    signature = inspect.signature(original(DFlashProposer.propose))

    def __init__(self, vllm_config, device, runner=None) -> None:
        stock_init(self, vllm_config, device, runner)
        setattr(self, _RUNNER, runner)
        setattr(self, _HISTORY, TokenHistory())

    def propose(self, *args, **kwargs):
        drafts = stock_propose(self, *args, **kwargs)
        runner = getattr(self, _RUNNER, None)
        tp = parallel_state._TP
        if (
            runner is None
            or not torch.is_tensor(drafts)
            or (tp is not None and tp.rank_in_group != 0)
        ):
            return drafts
        a = signature.bind(self, *args, **kwargs).arguments
        cad = a["common_attn_metadata"]
        k = drafts.shape[-1]
        # a partial draft head or a short block computed only the positions the
        # next step verifies; a short block is the block these drafts came from
        n = head_positions(self) if next_drafts(self) else k
        block = query_block(self) if next_drafts(self) else k
        records = collect_records(
            runner,
            getattr(self, _HISTORY),
            a["target_token_ids"],
            a["target_positions"],
            a["next_token_ids"],
            cad.query_start_loc_cpu,
            a.get("num_rejected_tokens_gpu"),
            drafts[:, :n],
            cad.seq_lens,
        )
        for r in records:
            r["block"] = block
        # A context-only pass drafts nothing: its tokens still go to the history
        # (with asynchronous scheduling the runner's token table lags behind).
        if next_drafts(self) != 0:
            writer.write(records)
        return drafts

    replace_attr(DFlashProposer, "__init__", __init__, NAME)
    replace_attr(DFlashProposer, "propose", propose, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.spec_decode.dflash:DFlashProposer.__init__",
        "vllm.v1.spec_decode.dflash:DFlashProposer.propose",
    ),
    summary="VLLM_DFLASH_TRACE=file.jsonl: one JSON line per request per drafting step.",
    why="Debug acceptance; tests compare drafts with an independent reference.",
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Keep (plugin feature).",
    when_probe_false=PatchState.NOT_APPLICABLE,
    probe_false_reason="VLLM_DFLASH_TRACE is not set",
    # wraps dflash_context_only_pass's propose, applied on this import
    trigger="vllm.v1.worker.gpu_model_runner",
)
