# SPDX-License-Identifier: Apache-2.0
"""vLLM's asynchronous-scheduling handling of the accepted-token counts, on a
synchronous runner (the CPU backend forces synchronous scheduling).

With asynchronous scheduling (vLLM's default on CUDA), ``_prepare_inputs`` maps
the host counts of hybrid targets through ``prev_positions`` (new row -> row of
the previous step) when a previous batch exists. :func:`install` makes vLLM's
own ``_prepare_inputs`` take that branch on the CPU backend: after each
``_update_states`` it sets ``use_async_scheduling`` and the previous step's
``req_id -> row`` map (as vLLM's async sampler path writes it), and clears both
when ``_prepare_inputs`` returns. Nothing else of the step sees them: within
``_prepare_inputs`` the flag selects only that branch (the GPU correction of
async spec decode is ``use_async_spec_decode``, fixed at start-up, and the
previous step's sampled tokens stay on the host). Used by
tests/e2e/test_hybrid_prefix_caching.py for dflash_align_accepted_counts_order.
Installed in the worker process by async_counts_site/sitecustomize.py.
"""

from __future__ import annotations


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_update = GPUModelRunner._update_states
    stock_prepare = GPUModelRunner._prepare_inputs

    def _update_states(self, scheduler_output):
        batch = self.input_batch
        previous = {r: i for i, r in enumerate(batch.req_ids) if r is not None}
        out = stock_update(self, scheduler_output)
        self.use_async_scheduling = True
        batch.prev_req_id_to_index = previous
        return out

    def _prepare_inputs(self, *args, **kwargs):
        try:
            return stock_prepare(self, *args, **kwargs)
        finally:
            self.use_async_scheduling = False
            self.input_batch.prev_req_id_to_index = None

    # probes of the plugin look through wrappers to vLLM's code (registry.original)
    _update_states.__wrapped_original__ = stock_update
    _prepare_inputs.__wrapped_original__ = stock_prepare
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
