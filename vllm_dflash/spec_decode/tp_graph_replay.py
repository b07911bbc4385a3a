# SPDX-License-Identifier: Apache-2.0
"""No DFlash drafter CUDA-graph replay inside a graph-capture session (TP > 1).

``DFlashProposer.dummy_run`` clamps every target size to ``max_query_tokens``,
so while vLLM captures the target's graphs (``profile_cudagraph_memory`` and
``capture_model``, both inside ``graph_capture()``) every target size above
that clamp asks for the same drafter graph: the first call captures it, the
next ones *replay* it. Inside the capture session custom all-reduce buffers
are not registered yet, so at tensor_parallel_size > 1 the replay reads
unregistered peer memory: "custom_all_reduce.cuh: an illegal memory access"
at start-up (same mechanism as vllm-project/vllm#28334). Measured on 2x H200
with vLLM 0.20.1 (stock and with the other patches).

Fix: within one capture session, a drafter graph size that is already captured
runs eagerly (a warm-up run is all the dummy call is for; inside the capture
session the eager custom all-reduce only allocates). Sessions start at
``profile_cudagraph_memory`` and ``capture_model``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from vllm_dflash.registry import V020, Patch, PatchKind, original, replace_attr

NAME = "dflash_tp_graph_replay"
_SEEN = "_vllm_dflash_captured_sizes"


class _Stop(Exception):
    pass


def probe() -> bool:
    """Ask vLLM's ``DFlashProposer.dummy_run`` which drafter batch size a large
    target size warms up: a clamp means every capture size past it replays one
    drafter graph (the defect)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    asked: list[int] = []

    def record(num_tokens: int, use_cudagraphs: bool = True):
        asked.append(num_tokens)
        raise _Stop

    fake = SimpleNamespace(
        max_query_tokens=4, _determine_batch_execution_and_padding=record
    )
    with contextlib.suppress(_Stop):
        original(DFlashProposer.dummy_run)(fake, 64)
    if not asked:
        raise RuntimeError("DFlashProposer.dummy_run asked for no drafter batch size")
    return asked[0] < 64


def graph_key(proposer, num_tokens: int) -> tuple:
    """The drafter graph a dummy run of ``num_tokens`` target tokens would use."""
    n = min(num_tokens, proposer.max_query_tokens)
    mode, num_input_tokens, _ = proposer._determine_batch_execution_and_padding(
        n, use_cudagraphs=True
    )
    return (str(mode), num_input_tokens)


def apply() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_dummy = original(DFlashProposer.dummy_run)
    stock_profile = original(GPUModelRunner.profile_cudagraph_memory)
    stock_capture = original(GPUModelRunner.capture_model)

    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings=None,
    ) -> None:
        if is_graph_capturing and use_cudagraphs:
            seen = self.__dict__.setdefault(_SEEN, set())
            key = graph_key(self, num_tokens)
            if key in seen:
                use_cudagraphs = False
            else:
                seen.add(key)
        stock_dummy(
            self,
            num_tokens,
            use_cudagraphs=use_cudagraphs,
            is_graph_capturing=is_graph_capturing,
            slot_mappings=slot_mappings,
        )

    def new_session(runner) -> None:
        drafter = getattr(runner, "drafter", None)
        if drafter is not None:
            drafter.__dict__.pop(_SEEN, None)

    def profile_cudagraph_memory(self, *args, **kwargs):
        new_session(self)
        try:
            return stock_profile(self, *args, **kwargs)
        finally:
            new_session(self)  # profiling graphs are cleared afterwards

    def capture_model(self, *args, **kwargs):
        new_session(self)
        return stock_capture(self, *args, **kwargs)

    replace_attr(DFlashProposer, "dummy_run", dummy_run, NAME)
    replace_attr(
        GPUModelRunner, "profile_cudagraph_memory", profile_cudagraph_memory, NAME
    )
    replace_attr(GPUModelRunner, "capture_model", capture_model, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    # First the model runner: it imports vllm.v1.spec_decode.dflash while it is
    # itself being imported, so the patch waits for the runner's import to end.
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_cudagraph_memory",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model",
        "vllm.v1.spec_decode.dflash:DFlashProposer.dummy_run",
    ),
    summary="No drafter CUDA-graph replay inside a capture session: DFlash starts at TP>1.",
    why="Every target size clamps to one drafter graph that is replayed while custom "
    "all-reduce buffers are unregistered: illegal memory access at start-up, TP>1.",
    upstream="none (same mechanism as vllm-project/vllm#28334)",
    versions=V020,
    platforms=("cuda", "rocm"),
    probe=probe,
    apply=apply,
    future="Upstream: capture each drafter graph size once per capture session.",
    probe_false_reason="DFlashProposer.dummy_run no longer clamps to max_query_tokens",
)
