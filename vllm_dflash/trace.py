# SPDX-License-Identifier: Apache-2.0
"""``VLLM_DFLASH_TRACE``: one JSON line per request per DFlash drafting step.

Record: ``{"request_id", "num_tokens", "last_token_ids", "draft_token_ids"}``,
where ``num_tokens`` is the length of the committed sequence including the
newest token (the one that opens the draft block), ``last_token_ids`` its last
min(4, num_tokens) tokens and ``draft_token_ids`` the k proposed tokens.
Installed only when the variable is set, so it costs nothing otherwise; when
set it syncs the device once per step (it is a debugging aid).
"""

from __future__ import annotations

import json
import os
import threading

import torch

from vllm_dflash import envs
from vllm_dflash.patches.registry import original, replace_attr

PATCH = "dflash_trace"
_lock = threading.Lock()


class TraceWriter:
    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        blob = "".join(json.dumps(r) + "\n" for r in records)
        with _lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(blob)


def collect_records(runner, drafts: torch.Tensor) -> list[dict]:
    """Build trace records for one drafting step (host copies: trace only)."""
    proposer = runner.drafter
    batch = drafts.shape[0]
    q = 1 + proposer.num_speculative_tokens
    # The proposer laid out each request's query block [newest, mask x k].
    newest_pos = proposer.positions[: batch * q : q].tolist()
    newest = proposer.input_ids[: batch * q : q].tolist()
    drafts_l = drafts.tolist()
    req_ids = runner.input_batch.req_ids[:batch]
    discard = runner.discard_request_mask.np[:batch].tolist()
    token_ids = runner.input_batch.token_ids_cpu
    records = []
    for i in range(batch):
        if discard[i]:
            continue  # partial prefill: the draft is thrown away
        n = int(newest_pos[i]) + 1
        prev = token_ids[i, max(0, n - 4) : n - 1].tolist()
        records.append(
            {
                "request_id": req_ids[i],
                "num_tokens": n,
                "last_token_ids": [int(t) for t in prev] + [int(newest[i])],
                "draft_token_ids": [int(t) for t in drafts_l[i]],
            }
        )
    return records


def probe() -> bool:
    return envs.trace_path() is not None


def apply() -> None:
    from vllm.distributed import parallel_state
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = original(GPUModelRunner.propose_draft_token_ids)
    writer = TraceWriter(os.path.abspath(envs.trace_path()))

    def propose_draft_token_ids(self, *args, **kwargs):
        drafts = stock(self, *args, **kwargs)
        if not isinstance(self.drafter, DFlashProposer) or not torch.is_tensor(drafts):
            return drafts
        tp = parallel_state._TP
        if tp is None or tp.rank_in_group == 0:
            writer.write(collect_records(self, drafts))
        return drafts

    replace_attr(
        GPUModelRunner, "propose_draft_token_ids", propose_draft_token_ids, PATCH
    )
