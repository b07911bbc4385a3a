# SPDX-License-Identifier: Apache-2.0
"""CPU defect 2: CPU linear layers drop ``.weight`` after repacking.

``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` replaces the weight
with an empty tensor, but the DFlash drafter's attention reads
``qkv_proj.weight`` directly (``F.linear``). Keep the weight of DFlash ``qkv_proj``
layers (the drafter is small); every other layer is repacked as before.
Hardware-dependent: only where oneDNN/SGL/zentorch repacking is active (the probe
says "not needed" on e.g. an AVX2-only CPU, where vLLM keeps every weight).
"""

from vllm_dflash.registry import (
    CPU_ONLY,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "cpu_keep_dflash_weights"
_KEEP = "_vllm_dflash_keep_weight"


def repacking_active() -> bool:
    """Whether CPU linears on this machine are repacked with the weight dropped.

    Only the oneDNN (vLLM's AVX-512 CPU extension), SGL and zentorch paths drop
    the weight; the plain torch fallback (e.g. the AVX2 extension) keeps it.
    """
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.platforms import current_platform

    return bool(
        ops._supports_onednn
        or envs.VLLM_CPU_SGL_KERNEL
        or current_platform.is_zen_cpu()
    )


def probe() -> bool:
    import inspect

    from vllm.model_executor.layers import linear
    from vllm.model_executor.models import qwen3_dflash

    removes = "remove_weight=True" in inspect.getsource(
        linear.UnquantizedLinearMethod.process_weights_after_loading
    )
    reads_raw = "qkv_proj.weight" in inspect.getsource(
        original(qwen3_dflash.DFlashQwen3Attention.forward)
    )
    return removes and reads_raw and repacking_active()


def apply() -> None:
    from vllm.model_executor.layers import utils
    from vllm.model_executor.models import qwen3_dflash

    # The current function, not vLLM's original: another CPU patch
    # (cpu_gdn_conv1d_weight) may already wrap it, and both must stay in place.
    stock_dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        keep = getattr(layer, _KEEP, False)
        stock_dispatch(layer, remove_weight=remove_weight and not keep)

    stock_init = original(qwen3_dflash.DFlashQwen3Attention.__init__)

    def __init__(self, *args, **kwargs) -> None:
        stock_init(self, *args, **kwargs)
        setattr(self.qkv_proj, _KEEP, True)

    replace_attr(
        utils, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm, NAME
    )
    replace_attr(qwen3_dflash.DFlashQwen3Attention, "__init__", __init__, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.CPU,
    # First the DFlash model module: it imports the linear layers and their utils
    # completely, so the patch applies once both are whole.
    targets=(
        "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Attention.__init__",
        "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
    ),
    summary="Keep qkv_proj.weight of DFlash layers when CPU linears are repacked.",
    why=(
        "The DFlash attention reads the raw weight (F.linear); oneDNN/SGL repacking "
        "(AVX-512 CPUs) deletes it. Not needed where repacking is inactive (AVX2)."
    ),
    upstream="none, CPU backend defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe,
    apply=apply,
    future="Upstream: DFlash attention should call qkv_proj() instead.",
)
