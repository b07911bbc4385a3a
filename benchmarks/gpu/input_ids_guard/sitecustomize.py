# SPDX-License-Identifier: Apache-2.0
"""Diagnosis aid (GPU harness only): stop an engine at the first out-of-range input id.

Put this folder first on ``PYTHONPATH`` and every Python process loads it: when
``vllm.v1.worker.gpu_model_runner`` is imported, ``GPUModelRunner._prepare_input_ids``
is wrapped so that after vLLM fills the step's input ids it reads them back (a host
sync each step: diagnosis only) and, if one is negative or past the vocabulary,
prints ``DEBUG_BAD_IDS`` (positions, values, batch rows) and the last four steps'
``DEBUG_STEP`` records (rows, scheduled and draft counts, previous positions, the
previous step's sampled and draft tensors), then exits the process with status 3.
Used by ``benchmarks/gpu/prefix_crash.sh``.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_HISTORY: collections.deque = collections.deque(maxlen=4)


def _step_record(runner: Any, so: Any, num_reqs: int) -> dict:
    batch = runner.input_batch
    req_ids = list(batch.req_ids[:num_reqs])
    prev = batch.prev_sampled_token_ids
    drafts = runner._draft_token_ids
    return {
        "req_ids": req_ids,
        "sched": [so.num_scheduled_tokens[r] for r in req_ids],
        "spec": [len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids],
        "prev_pos": runner.prev_positions.np[:num_reqs].tolist(),
        "prev_map": dict(batch.prev_req_id_to_index or {}),
        "prev_sampled": None if prev is None else prev.flatten().tolist(),
        "drafts": None if drafts is None else list(drafts.shape),
        "computed": [int(runner.requests[r].num_computed_tokens) for r in req_ids],
        "num_tokens": [int(runner.requests[r].num_tokens) for r in req_ids],
    }


def _wrap(module: Any) -> None:
    import numpy as np

    runner_cls = module.GPUModelRunner
    stock = runner_cls._prepare_input_ids

    def _prepare_input_ids(self, so, num_reqs, total, cu_num_tokens):
        record = _step_record(self, so, num_reqs)
        stock(self, so, num_reqs, total, cu_num_tokens)
        _HISTORY.append(record)
        ids = self.input_ids.gpu[:total]
        bad = ((ids < 0) | (ids >= self.input_batch.vocab_size)).nonzero().flatten()
        if bad.numel() == 0:
            return
        pos = bad[:40].tolist()
        rows = np.searchsorted(np.asarray(cu_num_tokens[:num_reqs]), pos, side="right")
        print("DEBUG_BAD_IDS", pos, "values", ids[bad[:40]].tolist(), "rows",
              rows.tolist(), "cu", list(cu_num_tokens[:num_reqs]), flush=True)  # fmt: skip
        for step in _HISTORY:
            print("DEBUG_STEP", step, flush=True)
        os._exit(3)

    runner_cls._prepare_input_ids = _prepare_input_ids


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the runner once its module has executed."""

    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.worker.gpu_model_runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def _exec(module):
            exec_module(module)
            _wrap(module)
            print("DEBUG input-id guard installed", flush=True)

        spec.loader.exec_module = _exec
        return spec


sys.meta_path.insert(0, _Finder())
