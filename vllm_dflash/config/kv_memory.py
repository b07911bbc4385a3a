# SPDX-License-Identifier: Apache-2.0
"""KV-cache / GDN-state memory of a target (+ DFlash drafter), from configs only.

Mirrors what vLLM 0.20.1 (+ this plugin) allocates, without importing vLLM:

* attention layer: ``2 * kv_heads * head_dim * dtype_bytes`` per token. DFlash
  drafter layers are all full size, sliding ones too (the plugin keeps sliding
  drafter layers' KV full size so no block holding precomputed context K/V is
  recycled; stock 0.20.x ignores the window altogether).
* Gated-DeltaNet layer (``linear_attention``): one state per block = conv state
  ``(conv_dim, kernel - 1 + k)`` + SSM state ``(v_heads, v_dim, k_dim)``; with
  speculative decoding stock vLLM gives each request ``1 + k`` of them
  (``MambaSpec`` ``num_speculative_blocks = k``, mamba cache mode ``none``). With
  DFlash and the plugin's ``dflash_gdn_state_replay`` (``gdn_replay=True``) a
  request holds one state whose page also carries a float32 ring of ``1 + k``
  verify records (``layers/ops/gdn_replay.py``).
* DFlash drafter attention layers with the target's attention bytes per token
  share the target's spec type (``dflash_drafter_kv_shared_group``; vLLM alone
  only when heads and head size are equal).
* hybrid models: the attention block size is the smallest multiple of the
  kernel block (16 on FlashAttention) whose target-attention page holds the GDN
  state (``Platform._align_hybrid_block_size``), the GDN page is padded to it,
  and every layer's page must equal it (``unify_kv_cache_spec_page_size``:
  smaller attention pages get a larger block, a larger page asserts).
* groups: layers with the same spec, split into groups of ``G`` layers (the
  smallest count, or the largest if it is < 1.5x the smallest); every block of
  every group costs ``G`` pages (``_get_kv_cache_groups_uniform_page_size``).
* max concurrency at ``context`` tokens = ``num_blocks / blocks per request``
  with ``num_blocks = available // page // G`` (``get_max_concurrency_for_kv_cache_config``).

``tests/unit/test_kv_memory.py`` checks these numbers against vLLM's own spec,
grouping and concurrency functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3
# Non-KV peak (activations, CUDA context) vLLM 0.20.1 measured for the 27B-shaped
# target on an H200 (docs/hybrid.md): 0.85 x 140.4 GiB - 50.95 GiB weights - 65.21
# GiB KV.
DEFAULT_OVERHEAD_GIB = 3.2

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
}


def dtype_bytes(name: str | None, default: str = "bfloat16") -> int:
    name = str(name or default).replace("torch.", "")
    if name == "auto":
        name = default
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPE_BYTES[name]


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def model_dtype(cfg: dict[str, Any]) -> str:
    t = text_config(cfg)
    return str(
        t.get("torch_dtype") or t.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    )


def head_dim(t: dict[str, Any]) -> int:
    return t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]


def attention_bytes_per_token(t: dict[str, Any], kv_bytes: int, tp: int = 1) -> int:
    kv_heads = max(1, t.get("num_key_value_heads", t["num_attention_heads"]) // tp)
    return 2 * kv_heads * head_dim(t) * kv_bytes


def target_layer_kinds(t: dict[str, Any]) -> list[str]:
    """``gdn`` or ``attention`` per target layer."""
    types = t.get("layer_types")
    if not types:
        return ["attention"] * t["num_hidden_layers"]
    return ["gdn" if x == "linear_attention" else "attention" for x in types]


def gdn_state_bytes(
    t: dict[str, Any], num_spec: int, conv_bytes: int, ssm_bytes: int, tp: int = 1
) -> tuple[int, int]:
    """(conv, SSM) bytes of one GDN state (``gated_delta_net_state_shape``)."""
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    kd, vd = t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv_dim = (kd * nk * 2 + vd * nv) // tp
    conv = conv_dim * (t["linear_conv_kernel_dim"] - 1 + num_spec) * conv_bytes
    ssm = (nv // tp) * vd * kd * ssm_bytes
    return conv, ssm


def gdn_ring_bytes(
    t: dict[str, Any], num_spec: int, tp: int = 1, value_bytes: int = 2
) -> int:
    """Bytes of the GDN state replay's record ring (``gdn_replay.RingLayout``;
    its values are in the model dtype)."""
    from vllm_dflash.layers.ops.gdn_replay import ring_layout

    layout = ring_layout(
        num_spec,
        t["linear_num_key_heads"],
        t["linear_num_value_heads"],
        t["linear_key_head_dim"],
        t["linear_value_head_dim"],
        tp,
    )
    return layout.length * value_bytes


def estimate_params(cfg: dict[str, Any], drafter: bool = False) -> int:
    """Parameter count from a config (no weights read; vision tower included)."""
    t = text_config(cfg)
    h, ffn, vocab = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    hd = head_dim(t)
    nq, nkv = t["num_attention_heads"], t.get("num_key_value_heads", 0)
    gate = 2 if t.get("attn_output_gate") else 1
    attn = h * nq * hd * gate + 2 * h * nkv * hd + nq * hd * h + 2 * hd
    mlp = 3 * h * ffn
    n = 0
    for kind in (
        ["attention"] * t["num_hidden_layers"] if drafter else target_layer_kinds(t)
    ):
        if kind == "gdn":
            nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
            kd, vd = t["linear_key_head_dim"], t["linear_value_head_dim"]
            conv_dim = 2 * nk * kd + nv * vd
            n += h * (conv_dim + nv * vd)  # in_proj_qkvz
            n += h * 2 * nv  # in_proj_ba
            n += conv_dim * t["linear_conv_kernel_dim"] + 2 * nv + vd
            n += nv * vd * h  # out_proj
        else:
            n += attn
        n += mlp + 2 * h
    if drafter:
        ids = (cfg.get("dflash_config") or {}).get("target_layer_ids") or []
        n += len(ids) * h * h + 2 * h  # fc + hidden_norm + norm (embeddings shared)
        return n
    n += (
        vocab
        * h
        * (1 if t.get("tie_word_embeddings", cfg.get("tie_word_embeddings")) else 2)
    )
    v = cfg.get("vision_config")
    if v:
        vh, vi = v["hidden_size"], v["intermediate_size"]
        merge = v.get("spatial_merge_size", 2) ** 2
        n += v["depth"] * (4 * vh * vh + 2 * vh * vi)
        n += vh * 3 * v.get("patch_size", 16) ** 2 * v.get("temporal_patch_size", 2)
        n += (vh * merge) ** 2 + vh * merge * v.get("out_hidden_size", h)
    return n


@dataclass
class KVPlan:
    """What vLLM allocates; all sizes in bytes."""

    num_spec: int
    kv_cache_dtype: str
    context: int
    hybrid: bool
    block_size: int  # attention block size of the target
    page: int  # unified page per layer (hybrid) or sum over layers (uniform)
    group_size: int
    groups: dict[str, int]  # spec label -> number of groups
    blocks_per_request: int
    target_kv_per_token: int
    drafter_kv_per_token: int
    gdn_layers: int = 0
    gdn_conv: int = 0
    gdn_ssm: int = 0
    gdn_state_copies: int = 0
    gdn_ring: int = 0  # bytes of the replay record ring per state (0: vLLM's copies)
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gdn_bytes_per_request(self) -> int:
        """GDN state bytes a request holds (unpadded: layers x copies x state)."""
        return (
            self.gdn_layers
            * self.gdn_state_copies
            * (self.gdn_conv + self.gdn_ssm + self.gdn_ring)
        )

    @property
    def bytes_per_request(self) -> int:
        """Allocated bytes per request at ``context`` (padding included)."""
        return self.blocks_per_request * self.group_size * self.page

    def num_blocks(self, available: int) -> int:
        return int(available // self.page // self.group_size)

    def max_concurrency(self, available: int) -> float:
        if self.error:
            return 0.0
        return self.num_blocks(available) / self.blocks_per_request


def plan(
    target: dict[str, Any],
    drafter: dict[str, Any] | None = None,
    num_spec: int = 0,
    kv_cache_dtype: str = "auto",
    context: int = 8192,
    tp: int = 1,
    kernel_block: int = 16,
    drafter_follows_kv_dtype: bool = True,
    mamba_ssm_cache_dtype: str = "auto",
    gdn_replay: bool = True,
    drafter_kv_shared: bool = True,
    prefix_caching: bool = False,
) -> KVPlan:
    """KV layout of ``target`` (+ ``drafter`` at ``num_spec`` draft tokens).

    ``prefix_caching``: hybrid targets run vLLM's 'align' mamba cache mode, where a
    request holds one GDN block more than its states (the block of the state it
    moves from: ``MambaSpec.max_memory_usage_bytes`` counts ``2 + k`` pages).

    ``gdn_replay``: hybrid targets with a drafter keep one GDN state + record
    ring per request (``dflash_gdn_state_replay``, the plugin's default); False:
    vLLM's ``1 + k`` state copies (the patch disabled, or stock vLLM).
    ``drafter_kv_shared``: drafter layers with the target's attention bytes per
    token join the target's attention type (``dflash_drafter_kv_shared_group``);
    False: only a drafter with the same KV heads and head size does (vLLM).

    ``drafter_follows_kv_dtype``: the drafter's KV uses ``kv_cache_dtype`` (vLLM
    0.22+, or 0.20.x with ``dflash_drafter_kv_cache_dtype``); False: model dtype
    (stock 0.20.x/0.21.x).
    """
    t = text_config(target)
    mdt = model_dtype(target)
    kv_b = dtype_bytes(kv_cache_dtype, mdt)
    k = num_spec if drafter is not None else 0
    kinds = target_layer_kinds(t)
    t_tok = attention_bytes_per_token(t, kv_b, tp)
    # spec label -> (layer count, bytes per token or None for GDN)
    specs: dict[str, list[Any]] = {}
    n_attn = kinds.count("attention")
    if n_attn:
        specs["target attention"] = [n_attn, t_tok]
    d_tok_layer = 0
    if drafter is not None:
        d_b = (
            kv_b if drafter_follows_kv_dtype else dtype_bytes(model_dtype(drafter), mdt)
        )
        d_tok_layer = attention_bytes_per_token(drafter, d_b, tp)
        n_d = drafter["num_hidden_layers"]
        same_shape = (drafter.get("num_key_value_heads"), head_dim(drafter)) == (
            t.get("num_key_value_heads"),
            head_dim(t),
        )
        copies = gdn_replay is False and "gdn" in kinds and k > 0
        if specs.get("target attention", [0, None])[1] == d_tok_layer and (
            same_shape or (drafter_kv_shared and not copies)
        ):
            specs["target attention"][0] += n_d  # one type
        else:
            specs["drafter attention"] = [n_d, d_tok_layer]
    n_gdn = kinds.count("gdn")
    hybrid = n_gdn > 0
    out = dict(
        num_spec=k,
        kv_cache_dtype=kv_cache_dtype,
        context=context,
        hybrid=hybrid,
        target_kv_per_token=n_attn * t_tok,
        drafter_kv_per_token=(drafter["num_hidden_layers"] * d_tok_layer)
        if drafter
        else 0,
    )
    if not hybrid:
        block = kernel_block
        page = block * sum(n * tok for n, tok in specs.values())
        blocks = math.ceil(context / block)
        return KVPlan(
            block_size=block,
            page=page,
            group_size=1,
            groups={"all attention (one group)": 1},
            blocks_per_request=blocks,
            **out,
        )
    conv_b = dtype_bytes("auto", mdt)
    ssm_dt = mamba_ssm_cache_dtype
    if ssm_dt == "auto":
        ssm_dt = t.get("mamba_ssm_dtype") or "auto"
    conv, ssm = gdn_state_bytes(t, k, conv_b, dtype_bytes(ssm_dt, mdt), tp)
    replay = gdn_replay and k > 0
    ring = gdn_ring_bytes(t, k, tp, dtype_bytes(mdt)) if replay else 0
    copies = 1 if replay else 1 + k
    mamba_page = conv + ssm + ring
    block = kernel_block * math.ceil(mamba_page / (kernel_block * t_tok))
    page = block * t_tok
    specs["GDN state"] = [n_gdn, None]
    error = None
    blocks_of: dict[str, int] = {}
    for label, (_, tok) in specs.items():
        if tok is None:
            blocks_of[label] = copies + (1 if prefix_caching else 0)
            continue
        layer_page = block * tok
        if layer_page > page:
            error = (
                f"{label} page {layer_page:,} B > GDN/target page {page:,} B: vLLM 0.20.1's "
                "unify_kv_cache_spec_page_size asserts (vllm#43626/#46480)"
            )
            blocks_of[label] = math.ceil(context / block)
        elif page % layer_page:
            error = f"{label} page {layer_page:,} B does not divide {page:,} B"
            blocks_of[label] = math.ceil(context / block)
        else:
            blocks_of[label] = math.ceil(context / (block * page // layer_page))
    counts = [n for n, _ in specs.values()]
    lo, hi = min(counts), max(counts)
    g = hi if hi < lo * 1.5 else lo
    groups = {label: math.ceil(n / g) for label, (n, _) in specs.items()}
    blocks = sum(groups[label] * blocks_of[label] for label in specs)
    return KVPlan(
        block_size=block,
        page=page,
        group_size=g,
        groups=groups,
        blocks_per_request=blocks,
        gdn_layers=n_gdn,
        gdn_conv=conv,
        gdn_ssm=ssm,
        gdn_state_copies=copies,
        gdn_ring=ring,
        error=error,
        **out,
    )


def available_kv_bytes(
    gpu_memory_gib: float,
    utilization: float,
    weights_bytes: int,
    overhead_gib: float,
) -> int:
    """What vLLM leaves for the KV cache: utilisation x memory - weights - peak."""
    return int(gpu_memory_gib * GIB * utilization - weights_bytes - overhead_gib * GIB)
