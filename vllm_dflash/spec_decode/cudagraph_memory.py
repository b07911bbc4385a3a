# SPDX-License-Identifier: Apache-2.0
"""DFlash engines: CUDA-graph memory measured over every graph, not extrapolated.

Before it sizes the KV cache, vLLM 0.20-0.23 (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``,
on by default) estimates the memory of the CUDA graphs it will capture:
``GPUModelRunner.profile_cudagraph_memory`` captures the first two graphs of each
mode (PIECEWISE, FULL) and charges ``first + second x (n - 1)``. Whatever the
second capture pays once (a first eager run of a new size, a lazily allocated
buffer) is multiplied by the number of graphs, and the estimate is taken out of
the KV cache. Measured on an H200 with the Qwen3.6-27B-shaped DFlash pair
(H200, 2026-12-02, c8a7a58): 6.60 GiB estimated, 0.88 GiB used
by the real capture, so the engine got 5.7 GiB less KV cache than its graphs need
(no speculation: 0.14 estimated, 0.12 used). The same linear extrapolation is
reported upstream for other models (vllm-project/vllm#45178, #53013).

Fix, DFlash engines only: inside ``profile_cudagraph_memory`` the first graph
warm-up and capture vLLM asks for captures *every* graph of every mode, in vLLM's
order, into the same profiling pool (FULL and PIECEWISE share one pool at run time
too), and the other calls capture nothing. vLLM's own bookkeeping then reads the
whole footprint as its "first capture" and 1 MiB (its floor) for each other graph:
the estimate is what the real capture uses, measured the way vLLM measures the
real one ("CUDA graph pool memory: ... (actual)"), plus ~1 MiB per graph. Set-up,
clean-up and the pool swap stay vLLM's. Cost: the graphs are captured twice at
start-up instead of two per mode (about as long as the real capture).
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_dflash.logger import init_logger
from vllm_dflash.registry import (
    V020,
    Patch,
    PatchKind,
    code_reads,
    original,
    replace_attr,
)
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

NAME = "dflash_cudagraph_memory_measured"
# Per runner, only while its profile_cudagraph_memory runs: None (not DFlash), or
# a list that is empty until the first warm-up-and-capture has captured them all.
_SESSION = "_vllm_dflash_graph_memory_session"


def probe() -> bool:
    """vLLM's estimator still samples graphs and extrapolates a per-graph cost."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = inspect.unwrap(original(GPUModelRunner.profile_cudagraph_memory))
    if not code_reads(stock, "_warmup_and_capture"):
        raise RuntimeError(
            "GPUModelRunner.profile_cudagraph_memory no longer captures through "
            "_warmup_and_capture"
        )
    return "per_graph" in stock.__code__.co_varnames


def profile_seq_lens(runner: Any, mode: Any, index: int, num_tokens: int) -> int | None:
    """The context length vLLM warms a graph up with during profiling: the first
    FULL graph at the longest sequences the token budget allows, others none."""
    from vllm.config import CUDAGraphMode

    if mode != CUDAGraphMode.FULL or index != 0:
        return None
    return min(runner.max_model_len, runner.max_num_tokens // num_tokens)


def capture_all(runner: Any, stock_warmup_and_capture: Any) -> int:
    """Warm up and capture every graph vLLM will capture; returns how many."""
    count = 0
    for mode, descs in runner.cudagraph_dispatcher.get_capture_descs():
        for i, desc in enumerate(descs):
            stock_warmup_and_capture(
                runner,
                desc,
                cudagraph_runtime_mode=mode,
                profile_seq_lens=profile_seq_lens(runner, mode, i, desc.num_tokens),
            )
            count += 1
    return count


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    inner_profile = GPUModelRunner.profile_cudagraph_memory  # may be another patch's
    stock_capture = GPUModelRunner._warmup_and_capture

    def profile_cudagraph_memory(self, *args, **kwargs):
        if not uses_dflash(self):
            return inner_profile(self, *args, **kwargs)
        setattr(self, _SESSION, [])
        try:
            estimate = inner_profile(self, *args, **kwargs)
        finally:
            captured = getattr(self, _SESSION)
            setattr(self, _SESSION, None)
        if captured:
            logger.info(
                "DFlash: CUDA graph memory measured over all %d graphs "
                "(vLLM extrapolates its second sample): %.2f GiB",
                captured[0],
                estimate / (1 << 30),
            )
        return estimate

    def _warmup_and_capture(self, desc, cudagraph_runtime_mode, *args, **kwargs):
        session = getattr(self, _SESSION, None)
        if session is None:  # not profiling a DFlash engine: vLLM's own
            return stock_capture(self, desc, cudagraph_runtime_mode, *args, **kwargs)
        if not session:  # the first sample: the whole footprint
            session.append(capture_all(self, stock_capture))
        return None  # the others: already captured

    replace_attr(
        GPUModelRunner, "profile_cudagraph_memory", profile_cudagraph_memory, NAME
    )
    replace_attr(GPUModelRunner, "_warmup_and_capture", _warmup_and_capture, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_cudagraph_memory",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._warmup_and_capture",
    ),
    summary=(
        "DFlash engines: the CUDA-graph memory taken out of the KV cache is measured "
        "over every graph instead of extrapolated from the second one."
    ),
    why=(
        "vLLM charges the second graph's one-off costs once per graph: 6.60 GiB "
        "estimated vs 0.88 GiB used on the Qwen3.6-27B-shaped DFlash pair (H200), "
        "5.7 GiB of KV cache lost."
    ),
    upstream="none merged (vllm-project/vllm#45178, #53013; open PR #51590 measures "
    "every descriptor)",
    versions=V020,
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Drop when vLLM measures every graph (the probe then reads no per_graph).",
    probe_false_reason="profile_cudagraph_memory no longer extrapolates a per-graph cost",
)
