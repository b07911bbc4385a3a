# SPDX-License-Identifier: Apache-2.0
"""``vllm-dflash inspect DRAFTER [--target TARGET]`` (reads configs and headers only)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_dflash.config import kv_memory
from vllm_dflash.config.drafter_validation import _safetensors_shapes, validate_dflash
from vllm_dflash.config.layer_types import resolve_layer_types

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def _config(path: str) -> dict[str, Any]:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: pass a local model directory")
    return json.loads(f.read_text())


def _ns(cfg: dict[str, Any]) -> SimpleNamespace:
    ns = SimpleNamespace(**cfg)
    if not cfg.get("use_sliding_window", True):
        ns.sliding_window = None  # as transformers' Qwen3Config does
    return ns


def inspect_drafter(
    drafter: str,
    target: str | None = None,
    aux_shift: bool = True,
    memory: dict[str, Any] | None = None,
) -> dict:
    """``memory``: keyword arguments of :func:`memory_report` (needs ``target``)."""
    raw = _config(drafter)
    cfg = _ns(raw)
    dflash = raw.get("dflash_config") or {}
    ids = list(dflash.get("target_layer_ids") or [])
    layer_types, window = resolve_layer_types(cfg)
    shapes = _safetensors_shapes(drafter)
    n_params = sum(math.prod(s) for s in shapes.values())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    kv_bytes = (
        len(layer_types)
        * 2
        * raw["num_key_value_heads"]
        * head_dim
        * _DTYPE_BYTES.get(dtype, 2)
    )
    report: dict[str, Any] = {
        "drafter": str(drafter),
        "architectures": raw.get("architectures"),
        "block_size": raw.get("block_size"),
        "max_num_speculative_tokens": (raw["block_size"] - 1)
        if raw.get("block_size")
        else None,
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": ids,
        "vllm_capture_indices": [i + 1 for i in ids] if aux_shift else ids,
        "layers": [
            {
                "index": i,
                "attention": t,
                "window": window if t == "sliding_attention" else None,
            }
            for i, t in enumerate(layer_types)
        ],
        "hidden_size": raw.get("hidden_size"),
        "parameters": n_params,
        "parameters_note": "drafter checkpoint only (embeddings/lm_head shared with the target)"
        if "embed_tokens.weight" not in shapes
        else "drafter checkpoint",
        "dtype": dtype,
        "draft_kv_bytes_per_token": kv_bytes,
        "validated_against": None,
    }
    if target:
        tcfg = _config(target)
        tcfg = tcfg.get("text_config", tcfg)
        validate_dflash(cfg, SimpleNamespace(**tcfg), None, drafter)
        report["validated_against"] = str(target)
        report["target_num_layers"] = tcfg["num_hidden_layers"]
        report["memory"] = memory_report(
            raw,
            _config(target),
            drafter_params=n_params or None,
            target_params=_checkpoint_params(target),
            **(memory or {}),
        )
    return report


def _checkpoint_params(model_dir: str) -> int | None:
    shapes = _safetensors_shapes(model_dir)
    return sum(math.prod(s) for s in shapes.values()) or None


def memory_report(
    drafter: dict[str, Any],
    target: dict[str, Any],
    num_speculative_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    context: int = 8192,
    gpu_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.9,
    overhead_gib: float = kv_memory.DEFAULT_OVERHEAD_GIB,
    tensor_parallel_size: int = 1,
    want_concurrency: float | None = None,
    drafter_params: int | None = None,
    target_params: int | None = None,
    gdn_replay: bool = True,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """Per-request GDN state / KV bytes and max concurrency (vLLM 0.20.1 + plugin).

    ``gdn_replay``: hybrid targets keep one GDN state + record ring per request
    (the plugin's ``dflash_gdn_state_replay``); False: vLLM's 1 + k copies.
    ``prefix_caching``: the 'align' mamba cache mode (no speculation too)."""
    k = num_speculative_tokens or max(1, (drafter.get("block_size") or 16) - 1)
    tp = tensor_parallel_size

    def plan_k(kk: int, kv: str = kv_cache_dtype, replay: bool = gdn_replay):
        return kv_memory.plan(
            target, drafter, kk, kv, context, tp, gdn_replay=replay,
            prefix_caching=prefix_caching,
        )  # fmt: skip

    p = plan_k(k)
    base = kv_memory.plan(
        target, None, 0, kv_cache_dtype, context, tp, prefix_caching=prefix_caching
    )
    out: dict[str, Any] = {
        "num_speculative_tokens": k,
        "kv_cache_dtype": kv_cache_dtype,
        "context": context,
        "prefix_caching": prefix_caching,
        "tensor_parallel_size": tp,
        "hybrid": p.hybrid,
        "target_kv_bytes_per_token": p.target_kv_per_token,
        "drafter_kv_bytes_per_token": p.drafter_kv_per_token,
        "drafter_sliding_layers_full_size": any(
            x == "sliding_attention" for x in drafter.get("layer_types") or []
        ),
        "gdn_layers": p.gdn_layers,
        "gdn_conv_state_bytes": p.gdn_conv,
        "gdn_ssm_state_bytes": p.gdn_ssm,
        "gdn_state_copies": p.gdn_state_copies,
        "gdn_replay": gdn_replay and p.hybrid,
        "gdn_ring_bytes": p.gdn_ring,
        "gdn_bytes_per_request": p.gdn_bytes_per_request,
        "block_size": p.block_size,
        "page_bytes": p.page,
        "group_size": p.group_size,
        "groups": p.groups,
        "blocks_per_request": p.blocks_per_request,
        "bytes_per_request": p.bytes_per_request,
        "no_spec_bytes_per_request": base.bytes_per_request,
        "error": p.error,
    }
    if gpu_memory_gib is None:
        return out
    mdt = kv_memory.model_dtype(target)
    tw = (target_params or kv_memory.estimate_params(target)) * kv_memory.dtype_bytes(
        mdt
    )
    dw = (
        drafter_params or kv_memory.estimate_params(drafter, drafter=True)
    ) * kv_memory.dtype_bytes(kv_memory.model_dtype(drafter), mdt)
    tw, dw = tw // tp, dw // tp
    avail = kv_memory.available_kv_bytes(
        gpu_memory_gib, gpu_memory_utilization, tw + dw, overhead_gib
    )
    avail_base = kv_memory.available_kv_bytes(
        gpu_memory_gib, gpu_memory_utilization, tw, overhead_gib
    )
    out.update(
        gpu_memory_gib=gpu_memory_gib,
        gpu_memory_utilization=gpu_memory_utilization,
        overhead_gib=overhead_gib,
        target_weight_bytes=tw,
        drafter_weight_bytes=dw,
        kv_memory_bytes=avail,
        num_blocks=p.num_blocks(max(avail, 0)),
        max_concurrency=p.max_concurrency(max(avail, 0)),
        no_spec_max_concurrency=base.max_concurrency(max(avail_base, 0)),
    )
    by_k = {}
    for kk in sorted({1, 3, 7, k, max(1, (drafter.get("block_size") or 16) - 1)}):
        by_k[kk] = plan_k(kk)
    out["max_concurrency_by_k"] = {
        kk: round(pk.max_concurrency(max(avail, 0)), 2) for kk, pk in by_k.items()
    }
    if kv_cache_dtype == "auto" and p.hybrid:
        f = plan_k(k, "fp8")
        out["fp8_max_concurrency"] = f.max_concurrency(max(avail, 0))
    if p.hybrid and gdn_replay:
        copies = plan_k(k, replay=False)
        out["vllm_copies_max_concurrency"] = copies.max_concurrency(max(avail, 0))
    hints = []
    if p.hybrid and p.gdn_layers and p.bytes_per_request:
        n = p.gdn_state_copies
        gdn_alloc = p.groups.get("GDN state", 0) * n * p.group_size * p.page
        what = (
            "the GDN state + replay ring"
            if n == 1
            else f"GDN state copies (1 + k = {n})"
        )
        hints.append(
            f"{what} are {100 * gdn_alloc / p.bytes_per_request:.0f}% "
            f"of a request's KV memory at {context} tokens"
        )
        if "vllm_copies_max_concurrency" in out:
            hints.append(
                f"with vLLM's 1 + k GDN state copies (VLLM_DFLASH_DISABLE="
                f"dflash_gdn_state_replay): {out['vllm_copies_max_concurrency']:.1f} "
                "requests"
            )
    want = want_concurrency
    if want:
        fits = [
            kk
            for kk in range(1, k + 1)
            if by_k.setdefault(kk, plan_k(kk)).max_concurrency(max(avail, 0)) >= want
        ]
        if fits:
            hints.append(f"k <= {max(fits)} fits {want:g} requests of {context} tokens")
        else:
            hints.append(f"no k fits {want:g} requests of {context} tokens")
        need = (want * p.bytes_per_request + tw + dw) / kv_memory.GIB + overhead_gib
        util = need / gpu_memory_gib
        hints.append(
            f"{want:g} requests at k={k} need {need:.1f} GiB in all: "
            + (
                f"--gpu-memory-utilization {util:.2f} on {gpu_memory_gib:g} GiB"
                if util <= 0.95
                else f"more than {gpu_memory_gib:g} GiB x 0.95 (more GPUs / TP, fewer tokens or a smaller k)"
            )
        )
    if "fp8_max_concurrency" in out:
        hints.append(
            f"--kv-cache-dtype fp8: {out['fp8_max_concurrency']:.1f} requests "
            "(FlashAttention 3 / Hopper; drafter KV in fp8 too)"
        )
    out["suggestions"] = hints
    return out


def format_report(r: dict) -> str:
    lines = [
        f"drafter            {r['drafter']}",
        f"architectures      {r['architectures']}",
        f"block_size         {r['block_size']} (num_speculative_tokens <= {r['max_num_speculative_tokens']})",
        f"mask_token_id      {r['mask_token_id']}",
        f"target_layer_ids   {r['target_layer_ids']} (as configured: outputs of these target layers)",
        f"vLLM capture index {r['vllm_capture_indices']} (residual stream before layer i = after layer i-1)",
        f"parameters         {r['parameters']:,} ({r['parameters_note']})",
        f"draft KV / token   {r['draft_kv_bytes_per_token']:,} bytes ({r['dtype']})",
        "layers:",
    ]
    for layer in r["layers"]:
        w = f", window {layer['window']}" if layer["window"] else ""
        lines.append(f"  {layer['index']:>3}  {layer['attention']}{w}")
    if r["validated_against"]:
        lines.append(
            f"valid for target   {r['validated_against']} ({r['target_num_layers']} layers)"
        )
    if r.get("memory"):
        lines += format_memory(r["memory"])
    return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def format_memory(m: dict) -> list[str]:
    k = m["num_speculative_tokens"]
    lines = [
        f"memory (vLLM 0.20.1 + vllm-dflash, k={k}, --kv-cache-dtype {m['kv_cache_dtype']}, "
        f"{m['context']} tokens, TP {m['tensor_parallel_size']}):",
        f"  target KV / token     {m['target_kv_bytes_per_token']:,} bytes",
        f"  drafter KV / token    {m['drafter_kv_bytes_per_token']:,} bytes"
        + (
            " (sliding layers allocate full size)"
            if m["drafter_sliding_layers_full_size"]
            else ""
        ),
    ]
    if m["hybrid"]:
        one = m["gdn_conv_state_bytes"] + m["gdn_ssm_state_bytes"] + m["gdn_ring_bytes"]
        ring = f" + replay ring {m['gdn_ring_bytes']:,}" if m["gdn_ring_bytes"] else ""
        copies = (
            "1 state + ring (dflash_gdn_state_replay)"
            if m["gdn_replay"]
            else f"{m['gdn_state_copies']} copies: 1 + k"
        )
        lines += [
            f"  GDN state / layer     {one:,} bytes (conv {m['gdn_conv_state_bytes']:,} "
            f"+ SSM {m['gdn_ssm_state_bytes']:,}{ring})",
            f"  GDN state / request   {_gb(m['gdn_bytes_per_request'])} "
            f"({m['gdn_layers']} layers x {copies})",
            f"  layout                block {m['block_size']} tokens, page {m['page_bytes']:,} bytes, "
            f"{sum(m['groups'].values())} groups of {m['group_size']} ("
            + ", ".join(f"{n} {label}" for label, n in m["groups"].items())
            + ")",
        ]
    lines.append(
        f"  KV / request          {_gb(m['bytes_per_request'])} allocated "
        f"({m['blocks_per_request']} blocks; without DFlash {_gb(m['no_spec_bytes_per_request'])})"
    )
    if m["error"]:
        lines.append(f"  ERROR                 {m['error']}")
    if "max_concurrency" in m:
        lines += [
            f"  KV memory             {m['kv_memory_bytes'] / kv_memory.GIB:.2f} GiB = "
            f"{m['gpu_memory_utilization']:g} x {m['gpu_memory_gib']:g} GiB - weights "
            f"{(m['target_weight_bytes'] + m['drafter_weight_bytes']) / kv_memory.GIB:.2f} GiB"
            f" (drafter {m['drafter_weight_bytes'] / kv_memory.GIB:.2f}) - peak {m['overhead_gib']:g} GiB",
            f"  max concurrency       {m['max_concurrency']:.1f} requests of {m['context']} tokens "
            f"({m['num_blocks']} blocks; without DFlash {m['no_spec_max_concurrency']:.1f})",
            "  by k                  "
            + ", ".join(
                f"k={kk}: {c:.1f}" for kk, c in m["max_concurrency_by_k"].items()
            ),
        ]
    for h in m.get("suggestions") or []:
        lines.append(f"  hint: {h}")
    return lines
