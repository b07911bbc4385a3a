# SPDX-License-Identifier: Apache-2.0
"""DFlash's spec-decode kernels compiled at start-up, not while serving.

On vLLM 0.20.x a DFlash engine compiles kernels during its first requests: on an
H200 (2026-12-03, feba7cb, call C) 34 Triton
compilations after the first request, inside steps of 117-3,216 ms, and a
first batch at 64 requests 22% slower than no speculation. Triton compiles one
variant per set of ``constexpr`` values and, for each integer argument, per class
of its value (1, a multiple of 16, other) and per pointer alignment; the
spec-decode helpers get batch sizes, token counts and draft lengths as integers,
so each new batch size or draft length can bring a new variant. vLLM's start-up
(``_dummy_run``, ``capture_model``, ``_dummy_sampler_run``) reaches none of them,
except the mixed-sampling rejection kernel.

In DFlash GPU workers (V1 runner, CUDA), this patch wraps
``Worker.compile_or_warm_up_model``:

* before vLLM's warm-up, it re-jits the four helpers that take batch-dependent
  integers (``KERNELS``) with every runtime argument de-specialised (value and
  alignment), and rebinds vLLM's module globals to them. Their variants then
  depend only on their ``constexpr`` values and pointer dtypes: 7 block sizes x
  2 for the input expansion, one per power of two up to ``k + 1`` for the
  next-token kernel, one each for the others. These kernels are launch-bound
  (one small program per request); losing the 1 / multiple-of-16 hints costs
  nothing measurable at their sizes;
* after vLLM's warm-up, it compiles those variants with ``JITFunction.warmup``
  (compile, no launch), the all-greedy variant of the greedy rejection kernel
  (vLLM's own FIXME: its start-up run is not all-greedy), and the four
  torch.compile graphs of ``update_num_computed_tokens_for_batch_change``
  (``dynamic=True`` still specialises sizes 0 and 1, and duck-sizes equal sizes:
  (n, m) = (1, 1), (1, a), (a, 1), (a, b) cover every later call);
* then it installs a tripwire on Triton's ``jit_cache_hook`` that records each
  later compilation (DEBUG line; JSONL in ``VLLM_DFLASH_JIT_LOG`` when set).

Nothing is written to the KV cache or to the runner's persistent state: the
Triton variants are compiled without launch, the rejection warm-up runs under a
forked RNG with a compile-only kernel, and the torch.compile warm-up uses
scratch tensors. A warm-up step that fails logs a warning and start-up goes on.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from vllm_dflash import envs
from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM
from vllm_dflash.logger import init_logger
from vllm_dflash.registry import V020_ONLY, Patch, PatchKind, code_reads, replace_attr
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

NAME = "dflash_jit_warmup"

# (module, global, argument names) of the Triton kernels that DFlash's decode path
# launches eagerly with batch-dependent integers. The names are checked by the
# probe: the warm-up passes them as keywords.
KERNELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "vllm.v1.spec_decode.dflash",
        "copy_and_expand_dflash_inputs_kernel",
        (
            "next_token_ids_ptr", "target_positions_ptr", "out_input_ids_ptr",
            "out_context_positions_ptr", "out_query_positions_ptr",
            "out_context_slot_mapping_ptr", "out_query_slot_mapping_ptr",
            "out_token_indices_ptr", "block_table_ptr", "block_table_stride",
            "query_start_loc_ptr", "num_rejected_tokens_ptr",
            "parallel_drafting_token_id", "block_size", "num_query_per_req",
            "num_speculative_tokens", "total_input_tokens", "BLOCK_SIZE",
            "HAS_NUM_REJECTED",
        ),
    ),
    (
        "vllm.v1.spec_decode.llm_base_proposer",
        "eagle_prepare_next_token_padded_kernel",
        (
            "sampled_token_ids_ptr", "discard_request_mask_ptr",
            "backup_next_token_ids_ptr", "next_token_ids_ptr",
            "valid_sampled_tokens_count_ptr", "vocab_size",
            "num_sampled_tokens_per_req", "num_reqs", "stride_sampled_token_ids",
            "BLOCK_SIZE_TOKENS",
        ),
    ),
    (
        "vllm.v1.spec_decode.llm_base_proposer",
        "eagle_prepare_inputs_padded_kernel",
        (
            "cu_num_draft_tokens_ptr", "valid_sampled_tokens_count_ptr",
            "query_start_loc_gpu_ptr", "token_indices_to_sample_ptr",
            "num_rejected_tokens_gpu_ptr", "num_reqs",
        ),
    ),
    (
        "vllm.v1.worker.block_table",
        "_compute_slot_mapping_kernel",
        (
            "num_tokens", "max_num_tokens", "query_start_loc_ptr", "positions_ptr",
            "block_table_ptr", "block_table_stride", "block_size",
            "slot_mapping_ptr", "TOTAL_CP_WORLD_SIZE", "TOTAL_CP_RANK",
            "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE",
        ),
    ),
)  # fmt: skip
_REJECTION = ("vllm.v1.sample.rejection_sampler", "rejection_greedy_sample_kernel")
_BATCH_CHANGE = (
    "vllm.v1.worker.gpu_model_runner",
    "update_num_computed_tokens_for_batch_change",
)
# copy_and_expand_dflash_inputs_kernel's BLOCK_SIZE: min(256, next_power_of_2(
# max_query_len + 1 + d)) with max_query_len >= 1 and d >= 1 (dflash.py).
EXPAND_BLOCK_SIZES = (4, 8, 16, 32, 64, 128, 256)
# On a de-specialised kernel.
_DESPECIALISED = "_vllm_dflash_despecialised"


next_power_of_2 = TRITON_SHIM.next_power_of_2  # triton.next_power_of_2, no driver


def next_token_block_sizes(k: int) -> tuple[int, ...]:
    """eagle_prepare_next_token_padded_kernel's BLOCK_SIZE_TOKENS for verify
    lengths 1..k+1 (next_power_of_2 of the step's longest verify)."""
    return tuple(sorted({next_power_of_2(t) for t in range(1, k + 2)}))


def batch_change_shapes(max_num_reqs: int) -> list[tuple[int, int]]:
    """(this batch's rows n, previous batch's rows m) that cover every later
    call of the dynamic-shape graph: 1 is specialised, sizes equal to each other
    or to the buffers' length ``max_num_reqs`` are duck-sized into one symbol;
    a graph traced on distinct sizes >= 2 is general."""
    free = list(range(2, min(max_num_reqs, 4)))
    shapes = [(1, 1)]
    if free:
        shapes += [(1, free[0]), (free[0], 1)]
    if len(free) >= 2:
        shapes.append((free[0], free[1]))
    return shapes


def _module_kernel(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _kernel_module(name: str) -> str:
    """The vLLM module that launches the ``KERNELS`` entry ``name``."""
    return next(module for module, kernel, _ in KERNELS if kernel == name)


def _kernel(name: str) -> Any:
    """The ``KERNELS`` entry ``name``, as vLLM's launching module holds it now."""
    return _module_kernel(_kernel_module(name), name)


def arg_names(kernel: Any) -> tuple[str, ...]:
    """A kernel's argument names (a JITFunction, or the plain function vLLM
    leaves in place when Triton has no driver)."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        names = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    return tuple(names)


def runtime_args(kernel: Any) -> list[str]:
    return [p.name for p in kernel.params if not p.is_constexpr]


def despecialised(kernel: Any) -> Any:
    """``kernel`` re-jitted with every runtime argument de-specialised."""
    import triton

    if getattr(kernel, _DESPECIALISED, False):
        return kernel
    names = runtime_args(kernel)
    new = triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(
        kernel.fn
    )
    setattr(new, _DESPECIALISED, True)
    return new


def despecialise_kernels() -> None:
    """Rebind vLLM's module globals to de-specialised kernels (this process)."""
    for module, name, _ in KERNELS:
        mod = importlib.import_module(module)
        replace_attr(mod, name, despecialised(getattr(mod, name)), NAME)


class _CompileOnly:
    """Stands in for a kernel: ``[grid](...)`` compiles the variant, no launch."""

    def __init__(self, kernel: Any, seen: list[str]) -> None:
        self.kernel = kernel
        self.seen = seen

    def __getitem__(self, grid: Any):
        def compile_only(*args: Any, **kwargs: Any) -> None:
            self.kernel.warmup(*args, grid=grid, **kwargs)
            self.seen.append(self.kernel.fn.__name__)

        return compile_only


@contextlib.contextmanager
def compile_only(module: str, name: str, seen: list[str]) -> Iterator[None]:
    mod = importlib.import_module(module)
    kernel = getattr(mod, name)
    setattr(mod, name, _CompileOnly(kernel, seen))
    try:
        yield
    finally:
        setattr(mod, name, kernel)


def _gpu(buf: Any) -> torch.Tensor:
    return getattr(buf, "gpu", buf)


def warm_expand(runner: Any, seen: list[str]) -> None:
    """copy_and_expand_dflash_inputs_kernel: every BLOCK_SIZE, with and without
    the rejected counts. Pointer dtypes are the drafter's buffers' and the ones
    vLLM allocates (int32 token ids, counts and indices)."""
    kernel = _kernel("copy_and_expand_dflash_inputs_kernel")
    drafter = runner.drafter
    dev = runner.device
    i32 = torch.zeros(1, dtype=torch.int32, device=dev)
    block_table = runner.input_batch.block_table[max(drafter.kv_cache_gid, 0)]
    table = block_table.get_device_tensor(1)
    for has_rejected in (False, True):
        for block in EXPAND_BLOCK_SIZES:
            kernel.warmup(
                next_token_ids_ptr=i32,
                target_positions_ptr=_gpu(runner.positions),
                out_input_ids_ptr=drafter.input_ids,
                out_context_positions_ptr=drafter._context_positions_buffer,
                out_query_positions_ptr=drafter.positions,
                out_context_slot_mapping_ptr=drafter._context_slot_mapping_buffer,
                out_query_slot_mapping_ptr=drafter._slot_mapping_buffer,
                out_token_indices_ptr=i32,
                block_table_ptr=table,
                block_table_stride=table.stride(0),
                query_start_loc_ptr=_gpu(runner.query_start_loc),
                num_rejected_tokens_ptr=i32 if has_rejected else 0,
                parallel_drafting_token_id=drafter.parallel_drafting_token_id,
                block_size=drafter.block_size,
                num_query_per_req=2,
                num_speculative_tokens=1,
                total_input_tokens=1,
                BLOCK_SIZE=block,
                HAS_NUM_REJECTED=has_rejected,
                grid=(1, 1),
            )
            seen.append(kernel.fn.__name__)


def warm_next_token(runner: Any, seen: list[str]) -> None:
    """eagle_prepare_next_token_padded_kernel: every BLOCK_SIZE_TOKENS for
    verify lengths 1..k+1; and eagle_prepare_inputs_padded_kernel."""
    kernel = _kernel("eagle_prepare_next_token_padded_kernel")
    dev = runner.device
    i32 = torch.zeros(1, dtype=torch.int32, device=dev)
    mask = torch.zeros(1, dtype=torch.bool, device=dev)
    k = runner.speculative_config.num_speculative_tokens
    for block in next_token_block_sizes(k):
        kernel.warmup(
            sampled_token_ids_ptr=i32,
            discard_request_mask_ptr=mask,
            backup_next_token_ids_ptr=i32,
            next_token_ids_ptr=i32,
            valid_sampled_tokens_count_ptr=i32,
            vocab_size=1,
            num_sampled_tokens_per_req=1,
            num_reqs=1,
            stride_sampled_token_ids=1,
            BLOCK_SIZE_TOKENS=block,
            grid=(1,),
        )
        seen.append(kernel.fn.__name__)
    kernel = _kernel("eagle_prepare_inputs_padded_kernel")
    kernel.warmup(
        cu_num_draft_tokens_ptr=i32,
        valid_sampled_tokens_count_ptr=i32,
        query_start_loc_gpu_ptr=i32,
        token_indices_to_sample_ptr=i32,
        num_rejected_tokens_gpu_ptr=i32,
        num_reqs=1,
        grid=(1,),
    )
    seen.append(kernel.fn.__name__)


def warm_slot_mapping(runner: Any, seen: list[str]) -> None:
    """_compute_slot_mapping_kernel through vLLM's own BlockTable wrapper, once
    per KV-cache group (their constants differ), compile-only."""
    name = "_compute_slot_mapping_kernel"
    tables = runner.input_batch.block_table.block_tables
    with compile_only(_kernel_module(name), name, seen):
        for table in tables:
            table.compute_slot_mapping(
                1, _gpu(runner.query_start_loc)[:2], _gpu(runner.positions)[:1]
            )


def warm_greedy_rejection(runner: Any, seen: list[str]) -> None:
    """rejection_greedy_sample_kernel's all-greedy variant, through vLLM's own
    rejection_sample (compile-only kernel; synthetic mode draws uniforms, under a
    forked RNG)."""
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    sampler = runner.rejection_sampler
    dev = torch.device(runner.device)
    meta = SpecDecodeMetadata.make_dummy([[0]], dev)

    class _AllGreedy:  # what rejection_sample reads on its all-greedy path
        all_greedy = True
        all_random = False
        generators: dict[int, torch.Generator] = {}

    devices = [dev.index or 0] if dev.type == "cuda" else []  # CPU: forked always
    with (
        torch.random.fork_rng(devices=devices),
        compile_only(*_REJECTION, seen),
    ):
        rs.rejection_sample(
            meta.draft_token_ids,
            meta.num_draft_tokens,
            meta.max_spec_len,
            meta.cu_num_draft_tokens,
            None,
            torch.zeros(1, 8, device=dev),
            torch.zeros(1, 1, dtype=torch.int32, device=dev),
            _AllGreedy(),  # type: ignore[arg-type]
            synthetic_mode=sampler.synthetic_mode,
            synthetic_conditional_rates=sampler.synthetic_conditional_rates,
        )


def warm_batch_change(runner: Any, seen: list[str]) -> None:
    """The dynamic-shape graphs of update_num_computed_tokens_for_batch_change,
    called as _prepare_inputs calls it: the runner's buffers (normal tensors,
    sliced under inference mode), the valid counts and the host values
    (inference tensors); Dynamo guards on that. Scratch copies of the buffers,
    prev_positions = -1: no row participates."""
    if not getattr(runner, "use_async_spec_decode", False):
        return
    fn = _module_kernel(*_BATCH_CHANGE)
    dev = runner.device
    host = runner.input_batch.num_computed_tokens_cpu_tensor

    def scratch(buf: torch.Tensor, fill: int) -> torch.Tensor:
        with torch.inference_mode(buf.is_inference()):  # as the runner's buffer
            return torch.full_like(buf, fill)

    computed = scratch(runner.num_computed_tokens, 0)
    accepted = scratch(_gpu(runner.num_accepted_tokens), 1)
    prev_positions = scratch(_gpu(runner.prev_positions), -1)
    prev_drafts = scratch(_gpu(runner.prev_num_draft_tokens), 0)
    with torch.inference_mode():
        for n, m in batch_change_shapes(computed.shape[0]):
            valid = torch.ones(m, dtype=torch.int32, device=dev)
            fn(
                computed,
                accepted[:n],
                prev_positions[:n],
                valid,
                prev_drafts,
                host[:n].to(device=dev, non_blocking=True),
            )
            seen.append(_BATCH_CHANGE[1])


WARM_STEPS = (
    warm_expand,
    warm_next_token,
    warm_slot_mapping,
    warm_greedy_rejection,
    warm_batch_change,
)


class Tripwire:
    """Triton's jit_cache_hook after the warm-up: each later compilation (or
    disk-cache load) of a kernel variant in this process is recorded."""

    def __init__(self, previous: Any, path: str | None) -> None:
        self.previous = previous
        self.path = path
        self.count = 0

    def __call__(self, **kwargs: Any) -> Any:
        if not kwargs.get("is_manual_warmup", False):
            self.count += 1
            fn = kwargs.get("fn")
            name = getattr(fn, "name", repr(fn))
            logger.debug("Triton JIT while serving: %s", kwargs.get("repr", name))
            if self.path:
                spec = kwargs.get("compile", {}).get("specialization_data")
                record = {
                    "time": time.time(),
                    "pid": os.getpid(),
                    "name": name,
                    "repr": kwargs.get("repr"),
                    "specialization_data": spec,
                }
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if self.previous is not None:
            return self.previous(**kwargs)
        return None


def install_tripwire() -> Tripwire:
    from triton import knobs

    current = knobs.runtime.jit_cache_hook
    if isinstance(current, Tripwire):
        return current
    wire = Tripwire(current, envs.jit_log_path())
    knobs.runtime.jit_cache_hook = wire
    return wire


def warm_up(runner: Any) -> int:
    """Compile every variant; return how many warm-up compilations were asked
    for (Triton skips those already in memory)."""
    seen: list[str] = []
    start = time.perf_counter()
    for step in WARM_STEPS:
        try:
            step(runner, seen)
        except Exception as e:  # a drifted signature must not stop the engine
            logger.warning(
                "vllm-dflash: %s skipped its %s (%s: %s); the first requests may "
                "compile kernels",
                NAME,
                step.__name__,
                type(e).__name__,
                e,
            )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    logger.info(
        "DFlash: compiled %d spec-decode kernel variants at start-up in %.1f s",
        len(seen),
        time.perf_counter() - start,
    )
    install_tripwire()
    return len(seen)


def runner_applies(worker: Any) -> bool:
    runner = getattr(worker, "model_runner", None)
    return (
        runner is not None
        and uses_dflash(runner)
        and getattr(runner, "drafter", None) is not None
        and not getattr(worker, "use_v2_model_runner", False)
    )


def probe() -> bool:
    """The kernels still take the arguments the warm-up passes, and vLLM's
    DFlash dummy run still never sets up the first pass (so nothing at start-up
    compiles the input-expansion kernel)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_worker import Worker

    for module, name, args in (*KERNELS, (*_REJECTION, ())):
        kernel = _module_kernel(module, name)
        kernel = getattr(kernel, "__wrapped_original__", kernel)
        if args and arg_names(kernel) != args:
            raise RuntimeError(
                f"{module}.{name} now takes {list(arg_names(kernel))}, the warm-up passes "
                f"{list(args)}"
            )
    if not callable(_module_kernel(*_BATCH_CHANGE)):
        raise RuntimeError(f"{'.'.join(_BATCH_CHANGE)} is gone")
    if not hasattr(Worker, "compile_or_warm_up_model"):
        raise RuntimeError("Worker.compile_or_warm_up_model is gone")
    return not code_reads(DFlashProposer.dummy_run, "set_inputs_first_pass")


def apply() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    stock = Worker.compile_or_warm_up_model

    def compile_or_warm_up_model(self, *args, **kwargs):
        if not runner_applies(self):
            return stock(self, *args, **kwargs)
        despecialise_kernels()
        result = stock(self, *args, **kwargs)
        warm_up(self.model_runner)
        return result

    replace_attr(Worker, "compile_or_warm_up_model", compile_or_warm_up_model, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model",
        *(f"{module}:{name}" for module, name, _ in KERNELS),
    ),
    summary=(
        "DFlash GPU workers compile the spec-decode kernel variants at start-up "
        "(their batch-dependent integer arguments de-specialised) instead of "
        "during the first requests."
    ),
    why=(
        "An H200 DFlash engine compiled 34 kernel variants after its first request, "
        "in steps of up to 3.2 s: the first batch at each new size was up to 22% "
        "slower than no speculation."
    ),
    upstream="none (vLLM's FIXME in rejection_greedy_sample_kernel; the V2 runner "
    "warms its kernels with a real step)",
    versions=V020_ONLY,
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Drop when vLLM's DFlash start-up compiles its spec-decode kernels.",
    probe_false_reason="DFlashProposer.dummy_run sets up the first pass",
)
