# SPDX-License-Identifier: Apache-2.0
"""Gated-DeltaNet state replay: one state per request instead of ``1 + k``.

vLLM 0.20.x gives every request of a speculative hybrid engine ``1 + k`` copies
of each GDN layer's recurrent state (``MambaSpec.num_speculative_blocks = k``):
the verify of ``1 + k`` tokens stores the state after each token, and the next
step reads the copy of the last accepted one. On the Qwen3.6-27B-shaped pair with
DFlash k = 15 that is 16 copies of 48 layers' states per request: an H200 held
26.9 concurrent 8k requests with DFlash against 111.3 without (issue #16).

With this patch a DFlash engine on a Qwen3.5/3.6 or Qwen3-Next target keeps one
state slot per request and, beside it in the same KV-cache page, a ring of ``1 +
k`` verify records (``layers/ops/gdn_replay.py``: per token the normalised key,
the delta-corrected value and the gate; 15% of one state on the 27B shapes). The
verify writes records instead of states; the next step first commits the
accepted records into the state (the verify's own arithmetic over the accepted
tokens, so the state equals the one vLLM would have kept), then runs as before.

Pieces (one patch, one off switch; each piece applied when its vLLM module is
imported, so a process that never loads a GDN model imports nothing more):

* ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``: inside a replay
  context the GDN state gets a third tensor, the ring (float32);
* ``Platform._align_hybrid_block_size``: the attention block size that vLLM
  matches to the mamba page is computed with the ring (replay context);
* ``GatedDeltaNetAttention.get_kv_cache_spec``: the ring in the page, no
  speculative copies (``num_speculative_blocks = 0``);
* ``GatedDeltaNetAttention._forward_core``: commit pending records of the batch's
  rows, then vLLM's forward with its speculative recurrent call served by the
  replay verify; non-speculative rows (prefill, plain decode) mark their ring
  empty afterwards;
* ``GDNAttentionMetadataBuilder.build``: the rows' state slots and accepted
  counts for the commit; the speculative slot table keeps its ``1 + k`` columns
  (one slot repeated) because kernels read its width as the verify length;
* ``GPUModelRunner.initialize_metadata_builders``: the GDN builders get the
  runner's accepted-count buffer (also for steps without drafts).

* ``mamba_utils.preprocess_mamba`` / ``postprocess_mamba`` (the 'align' mamba
  cache mode of prefix caching): the state moves between blocks as a whole page,
  and a block boundary inside the accepted tokens gets its state by a commit of
  the records up to it (``layers/gdn_replay_align.py``).

Only for DFlash engines.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from vllm_dflash import envs, import_hooks
from vllm_dflash.layers import gdn_replay_align as align
from vllm_dflash.layers.ops import gdn_replay
from vllm_dflash.logger import init_logger
from vllm_dflash.registry import (
    V020_ONLY,
    Patch,
    PatchError,
    PatchKind,
    code_reads,
    original,
    replace_attr,
)
from vllm_dflash.spec_decode import uses_dflash

logger = init_logger(__name__)

NAME = "dflash_gdn_state_replay"
# Model classes whose GDN layers are vLLM's GatedDeltaNetAttention.
ARCHITECTURES = frozenset(
    {
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
    }
)
MODULES = {
    "calculators": "vllm.model_executor.layers.mamba.mamba_utils",
    "platform": "vllm.platforms.interface",
    "layer": "vllm.model_executor.layers.mamba.gdn_linear_attn",
    "builder": "vllm.v1.attention.backends.gdn_attn",
    "runner": "vllm.v1.worker.gpu_model_runner",
    "align": "vllm.v1.worker.mamba_utils",
}
RUNNER_ACCEPTED_ATTR = "_vllm_dflash_accepted_buffer"
_LAYOUT_ATTR = "_vllm_dflash_ring_layout"
_REPLAYS_ATTR = "_vllm_dflash_replays"

# True while vLLM computes GDN state shapes for a replay engine.
_REPLAY_SHAPES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "vllm_dflash_gdn_replay_shapes", default=False
)
_applied: set[str] = set()  # pieces applied in this process
_failures: dict[str, str] = {}  # piece -> reason


def config_replays(vllm_config: Any) -> bool:
    """A DFlash engine on a GDN target, patch not disabled."""
    model = getattr(vllm_config, "model_config", None)
    return (
        uses_dflash(vllm_config)
        and model is not None
        and getattr(model, "architecture", None) in ARCHITECTURES
        and NAME not in envs.disabled_patches()
    )


def _layer_replays(layer: Any) -> bool:
    replays = getattr(layer, _REPLAYS_ATTR, None)
    if replays is None:
        replays = uses_dflash(layer)
        setattr(layer, _REPLAYS_ATTR, replays)
    return replays


def layer_layout(layer: Any) -> gdn_replay.RingLayout:
    layout = getattr(layer, _LAYOUT_ATTR, None)
    if layout is None:
        layout = gdn_replay.ring_layout(
            layer.num_spec,
            layer.num_k_heads,
            layer.num_v_heads,
            layer.head_k_dim,
            layer.head_v_dim,
            layer.tp_size,
        )
        setattr(layer, _LAYOUT_ATTR, layout)
    return layout


def ring_dtype(model_dtype: Any) -> torch.dtype:
    """The ring holds the layer's inputs as it received them: the model dtype."""
    if isinstance(model_dtype, torch.dtype):
        return model_dtype
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE[str(model_dtype)]


@contextlib.contextmanager
def replay_shapes():
    """GDN state shapes/dtypes computed inside carry the record ring."""
    token = _REPLAY_SHAPES.set(True)
    try:
        yield
    finally:
        _REPLAY_SHAPES.reset(token)


def require_all_pieces() -> None:
    """Refuse to run a replay engine with a piece missing (loud, one line)."""
    missing = [
        p
        for p in ("calculators", "layer", "builder", "runner", "align")
        if p not in _applied
    ]
    if _failures or missing:
        why = "; ".join(f"{k}: {v}" for k, v in _failures.items()) or (
            f"not applied: {', '.join(missing)}"
        )
        raise PatchError(
            f"DFlash cannot run: vllm-dflash patch {NAME!r} is incomplete in this "
            f"process ({why}). Disable it with VLLM_DFLASH_DISABLE={NAME} (vLLM's "
            f"1 + k state copies per request)."
        )


# --- calculators and block size (front end and workers) ------------------------


def _apply_calculators() -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    stock_shape = MambaStateShapeCalculator.gated_delta_net_state_shape.__func__
    stock_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype.__func__

    @classmethod  # type: ignore[misc]
    def gated_delta_net_state_shape(
        cls,
        tp_world_size,
        num_k_heads,
        num_v_heads,
        head_k_dim,
        head_v_dim,
        conv_kernel_size,
        num_spec=0,
    ):
        shapes = stock_shape(
            cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
            conv_kernel_size, num_spec,
        )  # fmt: skip
        if not _REPLAY_SHAPES.get():
            return shapes
        layout = gdn_replay.ring_layout(
            num_spec, num_k_heads, num_v_heads, head_k_dim, head_v_dim, tp_world_size
        )
        return (*shapes, (layout.length,))

    @classmethod  # type: ignore[misc]
    def gated_delta_net_state_dtype(
        cls, model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype="auto"
    ):
        dtypes = stock_dtype(cls, model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)
        if not _REPLAY_SHAPES.get():
            return dtypes
        return (*dtypes, ring_dtype(model_dtype))

    replace_attr(
        MambaStateShapeCalculator,
        "gated_delta_net_state_shape",
        gated_delta_net_state_shape,
        NAME,
    )
    replace_attr(
        MambaStateDtypeCalculator,
        "gated_delta_net_state_dtype",
        gated_delta_net_state_dtype,
        NAME,
    )


def _apply_platform() -> None:
    from vllm.platforms.interface import Platform

    stock = Platform._align_hybrid_block_size.__func__

    @classmethod  # type: ignore[misc]
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        if not config_replays(vllm_config):
            return stock(cls, vllm_config, backend_cls)
        with replay_shapes():
            return stock(cls, vllm_config, backend_cls)

    replace_attr(Platform, "_align_hybrid_block_size", _align_hybrid_block_size, NAME)


# --- the layer (workers) -----------------------------------------------------


def replay_kv_cache_spec(stock_spec: Callable[[], Any]) -> Any:
    """vLLM's GDN ``MambaSpec`` with the ring in the page and one state per
    request (``num_speculative_blocks = 0``)."""
    with replay_shapes():
        spec = stock_spec()
    if len(spec.shapes) != 3:
        raise PatchError(f"{NAME}: GDN state without the record ring: {spec}")
    return dataclasses.replace(spec, num_speculative_blocks=0)


def _replay_dispatch(prev, ring, layout, *args, **kwargs):
    """vLLM's recurrent GDN call: the speculative verify goes to the replay."""
    if args or kwargs.get("num_accepted_tokens") is None:
        return prev(*args, **_contiguous_qkv(kwargs))
    if kwargs.get("is_kda") or kwargs.get("inplace_final_state") is False:
        return prev(*args, **_contiguous_qkv(kwargs))
    if kwargs.get("beta", 1.0) != 1.0:
        raise PatchError(f"{NAME}: softplus beta != 1 is not supported")
    state = kwargs["initial_state"]
    gates = gdn_replay.Gates(
        kwargs["A_log"],
        kwargs["dt_bias"],
        kwargs.get("threshold", 20.0),
        kwargs.get("use_qk_l2norm_in_kernel", False),
    )
    o = gdn_replay.verify(
        kwargs["q"], kwargs["k"], kwargs["v"], kwargs["a"], kwargs["b"], gates,
        state, ring, layout, kwargs["cu_seqlens"], kwargs["ssm_state_indices"][:, 0],
        scale=kwargs.get("scale"),
    )  # fmt: skip
    return o, state


def _contiguous_qkv(kwargs: dict) -> dict:
    """vLLM's recurrent kernels read q/k/v as contiguous tensors."""
    for name in ("q", "k", "v"):
        if isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = kwargs[name].contiguous()
    return kwargs


def qkv_views(layer: Any, mixed_qkv: torch.Tensor | None):
    """vLLM's ``rearrange_mixed_qkv`` without its three ``.contiguous()`` copies
    (``gdn_replay.packed_qkv_views``). The replay verify reads any token/head
    stride; other recurrent calls get contiguous copies in ``_replay_dispatch``."""
    if mixed_qkv is None:
        return None, None, None
    return gdn_replay.packed_qkv_views(
        mixed_qkv,
        layer.key_dim // layer.tp_size // layer.head_k_dim,
        layer.value_dim // layer.tp_size // layer.head_v_dim,
        layer.head_k_dim,
        layer.head_v_dim,
    )


def forward_core(mod, stock, self, mixed_qkv, b, a, core_attn_out) -> None:
    """vLLM's ``_forward_core`` (of module ``mod``) with the records committed first."""
    all_metadata = mod.get_forward_context().attn_metadata
    if not _layer_replays(self) or all_metadata is None:  # profile run: no cache
        return stock(self, mixed_qkv, b, a, core_attn_out)
    md = all_metadata[self.prefix]
    if not hasattr(md, "replay_state_indices"):
        raise PatchError(
            f"{NAME}: GDN metadata without the replay fields (builder piece "
            "missing); DFlash cannot run"
        )
    layout = layer_layout(self)
    state, ring = self.kv_cache[1], self.kv_cache[2]
    if md.replay_num_accepted is not None:
        # the gates of vLLM's speculative call (threshold 20, l2-normalised q/k)
        gates = gdn_replay.Gates(self.A_log, self.dt_bias, 20.0, True)
        gdn_replay.commit(
            state, ring, layout, md.replay_state_indices, md.replay_num_accepted, gates
        )
    prev = mod.fused_sigmoid_gating_delta_rule_update
    mod.fused_sigmoid_gating_delta_rule_update = functools.partial(
        _replay_dispatch, prev, ring, layout
    )
    # the verify reads q/k/v in place: no copies (an instance attribute for
    # this call, removed after it)
    self.rearrange_mixed_qkv = functools.partial(qkv_views, self)
    try:
        stock(self, mixed_qkv, b, a, core_attn_out)
    finally:
        mod.fused_sigmoid_gating_delta_rule_update = prev
        del self.rearrange_mixed_qkv
    non_spec = md.non_spec_state_indices_tensor
    if non_spec is not None and (md.num_prefills > 0 or md.num_decodes > 0):
        # these rows' states are current: nothing of theirs is pending (padding
        # rows hold the null block; never a negative index)
        ring[:, 0].index_fill_(0, non_spec.long().clamp(min=0), 0.0)


def _apply_layer() -> None:
    from vllm.model_executor.layers.mamba import gdn_linear_attn as mod
    from vllm.model_executor.layers.mamba.gdn_linear_attn import (
        GatedDeltaNetAttention,
    )

    stock_spec = GatedDeltaNetAttention.get_kv_cache_spec
    stock_core = GatedDeltaNetAttention._forward_core

    def get_kv_cache_spec(self, vllm_config):
        if not _layer_replays(self):
            return stock_spec(self, vllm_config)
        for piece in ("builder", "runner", "align"):  # (imported by now)
            _apply_piece(piece)
        require_all_pieces()
        return replay_kv_cache_spec(lambda: stock_spec(self, vllm_config))

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        return forward_core(mod, stock_core, self, mixed_qkv, b, a, core_attn_out)

    replace_attr(GatedDeltaNetAttention, "get_kv_cache_spec", get_kv_cache_spec, NAME)
    replace_attr(GatedDeltaNetAttention, "_forward_core", _forward_core, NAME)


# --- metadata builder and runner (workers) -----------------------------------


def state_slots(builder: Any, metadata: Any, common: Any) -> torch.Tensor:
    """Each row's state slot. 'align' mode: the block of the row's last token
    (vLLM's ``mamba_get_block_table_tensor``); a batch of speculative decodes only
    reads it from the builder's slot buffer, which FULL CUDA graphs capture."""
    if builder.vllm_config.cache_config.mamba_cache_mode != "align":
        return common.block_table_tensor[:, 0]
    spec = metadata.spec_state_indices_tensor
    if spec is not None and metadata.num_prefills == 0 and metadata.num_decodes == 0:
        return spec[:, 0]
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    return mamba_get_block_table_tensor(
        common.block_table_tensor, common.seq_lens, builder.kv_cache_spec, "align"
    )[:, 0]


def add_replay_fields(builder: Any, metadata: Any, common: Any, accepted) -> Any:
    """The rows' state slots and accepted counts; ``1 + k`` slot columns."""
    from vllm_dflash.attention.gdn_shared_metadata import spec_columns

    rows = common.num_reqs
    metadata.replay_state_indices = state_slots(builder, metadata, common)[:rows]
    buf = getattr(builder, RUNNER_ACCEPTED_ATTR, None)
    if buf is not None:
        metadata.replay_num_accepted = buf.gpu[:rows]
    else:  # a runner we did not set up (tests): the step's counts, if any
        metadata.replay_num_accepted = None if accepted is None else accepted[:rows]
    if metadata.spec_state_indices_tensor is not None:
        metadata.spec_state_indices_tensor = spec_columns(
            metadata.spec_state_indices_tensor, builder.num_spec + 1
        )
    return metadata


def _apply_builder() -> None:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    stock = GDNAttentionMetadataBuilder.build

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        metadata = stock(
            self,
            common_prefix_len,
            common_attn_metadata,
            num_accepted_tokens=num_accepted_tokens,
            num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu,
            fast_build=fast_build,
        )
        replays = getattr(self, _REPLAYS_ATTR, None)
        if replays is None:  # decided once per builder
            replays = config_replays(self.vllm_config)
            setattr(self, _REPLAYS_ATTR, replays)
        if replays:
            add_replay_fields(self, metadata, common_attn_metadata, num_accepted_tokens)
        return metadata

    replace_attr(GDNAttentionMetadataBuilder, "build", build, NAME)


def _apply_runner() -> None:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = GPUModelRunner.initialize_metadata_builders

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes):
        stock(self, kv_cache_config, kernel_block_sizes)
        for groups in self.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    if isinstance(builder, GDNAttentionMetadataBuilder):
                        setattr(builder, RUNNER_ACCEPTED_ATTR, self.num_accepted_tokens)

    replace_attr(
        GPUModelRunner,
        "initialize_metadata_builders",
        initialize_metadata_builders,
        NAME,
    )


def _apply_align() -> None:
    from vllm.v1.worker import mamba_utils

    stock_pre = mamba_utils.preprocess_mamba
    stock_post = mamba_utils.postprocess_mamba

    def preprocess_mamba(
        scheduler_output, kv_cache_config, cache_config, mamba_state_idx,
        input_batch, requests, forward_context, mamba_state_copy_funcs, copy_bufs,
    ):  # fmt: skip
        args = (
            scheduler_output, kv_cache_config, cache_config, mamba_state_idx,
            input_batch, requests, forward_context, mamba_state_copy_funcs,
            copy_bufs,
        )  # fmt: skip
        if not align.engine_replays(
            kv_cache_config, copy_bufs, forward_context, _layer_replays
        ):
            return stock_pre(*args)
        return align.preprocess(stock_pre, *args)

    def postprocess_mamba(
        scheduler_output, kv_cache_config, input_batch, requests, mamba_state_idx,
        forward_context, mamba_state_copy_funcs, copy_bufs,
    ):  # fmt: skip
        args = (
            scheduler_output, kv_cache_config, input_batch, requests,
            mamba_state_idx, forward_context, mamba_state_copy_funcs, copy_bufs,
        )  # fmt: skip
        if not align.engine_replays(
            kv_cache_config, copy_bufs, forward_context, _layer_replays
        ):
            return stock_post(*args)
        return align.postprocess(
            *args,
            collect=mamba_utils.collect_mamba_copy_meta,
            memcpy=mamba_utils.batch_memcpy,
            layout_of=layer_layout,
        )

    replace_attr(mamba_utils, "preprocess_mamba", preprocess_mamba, NAME)
    replace_attr(mamba_utils, "postprocess_mamba", postprocess_mamba, NAME)


_PIECES = {
    "calculators": _apply_calculators,
    "platform": _apply_platform,
    "layer": _apply_layer,
    "builder": _apply_builder,
    "runner": _apply_runner,
    "align": _apply_align,
}


def _apply_piece(piece: str) -> None:
    """Apply one piece (idempotent: each target is replaced once)."""
    try:
        _PIECES[piece]()
    except Exception as e:  # the target moved: DFlash on a hybrid target refuses
        _failures[piece] = f"{type(e).__name__}: {e}"
        logger.error(
            "vllm-dflash patch %r: %s (%s) failed: %s; DFlash on hybrid targets "
            "will refuse to start",
            NAME,
            piece,
            MODULES[piece],
            _failures[piece],
        )
        return
    _failures.pop(piece, None)
    _applied.add(piece)


def probe() -> bool:
    """vLLM reserves 1 + k state pages per speculative request, and has no GDN
    state replay of its own (``use_gdn_state_replay``, which
    ``patches/v0.20.1/0017`` adds to ``mamba_utils``: the probe's trigger module,
    already imported)."""
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import MambaSpec

    if hasattr(mamba_utils, "use_gdn_state_replay"):
        return False

    spec = MambaSpec(
        shapes=((4,),), dtypes=(torch.float32,), block_size=1, num_speculative_blocks=3
    )
    cfg = type("Cfg", (), {"cache_config": type("C", (), {"mamba_cache_mode": "none"})})
    from vllm.platforms.interface import Platform

    raw = original(Platform.__dict__["_align_hybrid_block_size"])  # vLLM's classmethod
    if not code_reads(
        getattr(raw, "__func__", raw), "get_mamba_state_shape_from_config"
    ):
        raise RuntimeError(
            "Platform._align_hybrid_block_size no longer sizes pages from "
            "get_mamba_state_shape_from_config"
        )
    return spec.max_memory_usage_bytes(cfg) == 4 * spec.page_size_bytes


def _importing(module: str) -> bool:
    """The module is being imported right now (in sys.modules, not finished)."""
    m = sys.modules.get(module)
    spec = getattr(m, "__spec__", None)
    return m is not None and bool(getattr(spec, "_initializing", False))


def apply() -> None:
    _apply_piece("calculators")
    _apply_piece("platform")
    for piece in ("layer", "builder", "runner", "align"):
        if _importing(MODULES[piece]):
            continue  # applied when a replay layer asks for its KV spec (worker)
        import_hooks.when_imported(
            MODULES[piece], functools.partial(_apply_piece, piece)
        )
    if _failures:
        raise PatchError("; ".join(f"{k}: {v}" for k, v in _failures.items()))


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.model_executor.layers.mamba.mamba_utils:"
        "MambaStateShapeCalculator.gated_delta_net_state_shape",
        "vllm.model_executor.layers.mamba.mamba_utils:"
        "MambaStateDtypeCalculator.gated_delta_net_state_dtype",
        "vllm.platforms.interface:Platform._align_hybrid_block_size",
        "vllm.model_executor.layers.mamba.gdn_linear_attn:"
        "GatedDeltaNetAttention.get_kv_cache_spec",
        "vllm.model_executor.layers.mamba.gdn_linear_attn:"
        "GatedDeltaNetAttention._forward_core",
        "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_metadata_builders",
        "vllm.v1.worker.mamba_utils:preprocess_mamba",
        "vllm.v1.worker.mamba_utils:postprocess_mamba",
    ),
    summary=(
        "DFlash on Qwen3.5/3.6 and Qwen3-Next targets: one GDN state per request plus "
        "a ring of verify records (committed over the accepted tokens next step), "
        "instead of 1 + k state copies; with prefix caching ('align' mode) the page "
        "moves whole and a block boundary gets the records committed up to it."
    ),
    why=(
        "vLLM's 1 + k copies per request (16 at k = 15) cut the requests a GPU holds: "
        "26.9 vs 111.3 concurrent 8k requests on the Qwen3.6-27B-shaped pair (H200); "
        "with prefix caching 27,506 vs 168,391 KV tokens for no speculation (H100)."
    ),
    upstream=(
        "none merged (related, open: vllm-project/vllm#49887 ReplaySSM); our diff: "
        "patches/v0.20.1/0017-gdn-state-replay.diff"
    ),
    versions=V020_ONLY,  # the 0.20.x GDN layer, builder and runner
    platforms=("cuda", "cpu"),
    probe=probe,
    apply=apply,
    future="Drop when vLLM keeps one GDN state per speculative request.",
    probe_false_reason=(
        "vLLM no longer reserves 1 + k GDN state pages per request, or replays "
        "GDN states itself"
    ),
)
