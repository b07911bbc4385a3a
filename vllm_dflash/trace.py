# SPDX-License-Identifier: Apache-2.0
"""``VLLM_DFLASH_TRACE``: one JSON line per request per DFlash drafting step.

Record: ``{"request_id", "num_tokens", "last_token_ids", "draft_token_ids"}``,
where ``num_tokens`` is the length of the committed sequence including the
newest token (the one that opens the draft block), ``last_token_ids`` its last
min(4, num_tokens) tokens and ``draft_token_ids`` the k proposed tokens.

The hook is installed only when the variable is set, so it costs nothing
otherwise; when set it copies a few small tensors to the host once per step (a
debugging aid). Tokens are read from the drafting step's own inputs (the
step's context tokens and the newest token), which is right with asynchronous
scheduling too; older tokens come from the runner's committed token table.
"""

from __future__ import annotations

import json
import os
import threading

import torch

from vllm_dflash import envs
from vllm_dflash.patches.registry import original, replace_attr

PATCH = "dflash_trace"
_RUNNER = "_vllm_dflash_runner"
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


def collect_records(
    runner,
    target_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    next_token_ids: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    num_rejected: torch.Tensor | None,
    drafts: torch.Tensor,
) -> list[dict]:
    batch = drafts.shape[0]
    tokens = target_token_ids.tolist()
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
        if discard[i]:
            continue  # partial prefill: the draft is thrown away
        start, end = qsl[i], qsl[i + 1] - rejected[i]
        if end <= start:
            continue
        step = dict(zip(positions[start:end], tokens[start:end], strict=True))
        n = positions[end - 1] + 2  # newest token sits right after the last context one
        prev = [step.get(p, int(table[i, p])) for p in range(max(0, n - 4), n - 1)]
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
    import inspect

    from vllm.distributed import parallel_state
    from vllm.v1.spec_decode.dflash import DFlashProposer

    writer = TraceWriter(os.path.abspath(envs.trace_path()))
    stock_init = original(DFlashProposer.__init__)
    stock_propose = original(DFlashProposer.propose)
    signature = inspect.signature(stock_propose)

    def __init__(self, vllm_config, device, runner=None) -> None:
        stock_init(self, vllm_config, device, runner)
        setattr(self, _RUNNER, runner)

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
        writer.write(
            collect_records(
                runner,
                a["target_token_ids"],
                a["target_positions"],
                a["next_token_ids"],
                cad.query_start_loc_cpu,
                a.get("num_rejected_tokens_gpu"),
                drafts,
            )
        )
        return drafts

    replace_attr(DFlashProposer, "__init__", __init__, PATCH)
    replace_attr(DFlashProposer, "propose", propose, PATCH)
