# SPDX-License-Identifier: Apache-2.0
"""GPU time of one Gated-DeltaNet decode token per request: vLLM's two paths.

    python benchmarks/gpu/gdn_paths.py OUT.jsonl [--batches 64,128,256] [--layers 48]

A DFlash engine on a hybrid target runs every decode through GDN's *speculative* path
(``causal_conv1d_update`` with ``num_accepted_tokens`` + ``rearrange_mixed_qkv`` +
``fused_sigmoid_gating_delta_rule_update`` over ``[batch, 1 + k]`` state slots), also
when a step verifies 0 drafts (``dflash_gdn_zero_draft_decodes``). A no-speculation
engine runs the *packed* decode (``causal_conv1d_update`` +
``fused_recurrent_gated_delta_rule_packed_decode``). This times both for one token per
request with the Qwen3.6-27B linear-attention shapes (16 key heads, 48 value heads,
head dim 128, conv width 4, bf16 states), ``--layers`` calls captured in one CUDA graph
(the engine runs them inside graphs), median of ``--repeats`` replays.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _graph_ms(fn, repeats: int) -> list[float]:
    fn()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    out = []
    for _ in range(repeats):
        s, e = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument(
        "--replays",
        default="1:1,4:3",
        help="replay shapes TOKENS:ACCEPTED (verify TOKENS a request after a commit "
        "of ACCEPTED records), e.g. 1:1,4:3,16:8",
    )
    ap.add_argument(
        "--no-vllm", action="store_true", help="skip vLLM's two decode paths"
    )
    args = ap.parse_args()
    replays = [tuple(int(x) for x in r.split(":")) for r in args.replays.split(",")]
    for n in [int(x) for x in args.batches.split(",")]:
        results = (
            [] if args.no_vllm else [_measure(n, args.layers, args.repeats, args.k)]
        )
        for tokens, accepted in replays:
            results.append(
                _replay(n, args.layers, args.repeats, args.k, tokens, accepted)
            )
        for res in results:
            print("RESULT", json.dumps(res), flush=True)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(res) + "\n")
        torch.cuda.empty_cache()


# value-block widths of the replay kernels to time (None: the width
# ``value_block`` picks for the batch, as shipped); one warp each (two and four
# warps were slower on the H200, 2026-12-03).
WIDTHS = {"shipped": None, "bv32": 32, "bv16": 16, "bv8": 8}


def _replay(
    n: int, layers: int, repeats: int, num_spec: int, tokens: int, accepted: int
) -> dict:
    """The plugin's GDN state replay (``dflash_gdn_state_replay``): the commit of
    ``accepted`` pending records, then the verify of ``tokens`` tokens per request,
    each kernel alone, per launch configuration; and vLLM's packed decode kernel
    (recurrence only, one token) on the same state for reference."""
    from vllm.model_executor.layers.fla.ops import (
        fused_recurrent_gated_delta_rule_packed_decode,
    )

    from vllm_dflash.layers.ops import gdn_replay, gdn_replay_triton

    dev = torch.device("cuda")
    dt = torch.bfloat16
    hk, hv, dk, dv = 16, 48, 128, 128
    layout = gdn_replay.ring_layout(num_spec, hk, hv, dk, dv)
    torch.manual_seed(0)
    state = torch.randn(n + 1, hv, dv, dk, device=dev, dtype=dt) * 0.01
    ring = torch.randn(n + 1, layout.length, device=dev, dtype=dt) * 0.1
    # steps of one token leave nothing pending (the verify stored the state)
    pending = 1.0 if tokens > 1 else 0.0
    ring[:, 0] = pending
    gates = gdn_replay.Gates(
        A_log=torch.randn(hv, device=dev), dt_bias=torch.randn(hv, device=dev)
    )
    slots = torch.arange(1, n + 1, device=dev, dtype=torch.int32)
    acc = torch.full((n,), accepted, device=dev, dtype=torch.int32)
    t = n * tokens
    # views of the packed qkv, as the layer passes them (``qkv_views``)
    mixed_qkv = torch.randn(t, 2 * hk * dk + hv * dv, device=dev, dtype=dt)
    q, k, v = gdn_replay.packed_qkv_views(mixed_qkv, hk, hv, dk, dv)
    a = torch.randn(t, hv, device=dev, dtype=dt)
    b = torch.randn(t, hv, device=dev, dtype=dt)
    cu = torch.arange(0, t + 1, tokens, device=dev, dtype=torch.int32)
    res: dict = {
        "batch": n,
        "layers": layers,
        "replay_tokens": tokens,
        "accepted": accepted,
    }
    res["shipped_bv"] = gdn_replay_triton.value_block(layout, n)
    for tag, bv in WIDTHS.items():

        def commit(bv=bv) -> None:
            for _ in range(layers):
                ring[:, 0] = pending
                gdn_replay_triton.commit(state, ring, layout, slots, acc, gates, bv=bv)

        def verify(bv=bv) -> None:
            for _ in range(layers):
                gdn_replay_triton.verify(
                    q, k, v, a, b, gates, state, ring, layout, cu, slots, dk**-0.5,
                    bv=bv,
                )  # fmt: skip

        if tag == "bv32":
            # the shipped path before this change: vLLM's rearrange_mixed_qkv copied q, k, v
            # (three kernels a layer), then the verify ran 32-wide blocks
            def copied() -> None:
                for _ in range(layers):
                    gdn_replay_triton.verify(
                        q.contiguous(), k.contiguous(), v.contiguous(), a, b, gates,
                        state, ring, layout, cu, slots, dk**-0.5, bv=32,
                    )  # fmt: skip

            ms = _graph_ms(copied, repeats)
            res["verify_copies_bv32_ms"] = round(statistics.median(ms), 3)

        for name, fn in (("commit", commit), ("verify", verify)):
            try:
                ms = _graph_ms(fn, repeats)
                res[f"{name}_{tag}_ms"] = round(statistics.median(ms), 3)
            except Exception as e:  # a configuration Triton cannot compile
                res[f"{name}_{tag}_ms"] = f"error: {type(e).__name__}"
    if tokens == 1:
        mixed = torch.randn(n, 2 * hk * dk + hv * dv, device=dev, dtype=dt)
        out = torch.zeros(n, 1, hv, dv, device=dev, dtype=dt)

        def packed() -> None:
            for _ in range(layers):
                fused_recurrent_gated_delta_rule_packed_decode(
                    mixed_qkv=mixed, a=a, b=b, A_log=gates.A_log, dt_bias=gates.dt_bias,
                    scale=dk**-0.5, initial_state=state, out=out,
                    ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                )  # fmt: skip

        res["packed_recurrence_ms"] = round(
            statistics.median(_graph_ms(packed, repeats)), 3
        )
    return res


def _measure(n: int, layers: int, repeats: int, num_spec: int) -> dict:
    from vllm.model_executor.layers.fla.ops import (
        fused_recurrent_gated_delta_rule_packed_decode,
        fused_sigmoid_gating_delta_rule_update,
    )
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    dev = torch.device("cuda")
    dt = torch.bfloat16
    hk, hv, dk, dv, width = 16, 48, 128, 128, 4
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    slots_per_req = 1 + num_spec
    torch.manual_seed(0)
    slots = n * slots_per_req + 1
    state_len = width - 1 + num_spec
    if is_conv_state_dim_first():
        conv_state = torch.randn(slots, conv_dim, state_len, device=dev, dtype=dt)
    else:
        conv_state = torch.randn(slots, state_len, conv_dim, device=dev, dtype=dt)
        conv_state = conv_state.transpose(-1, -2)
    ssm = torch.randn(slots, hv, dv, dk, device=dev, dtype=dt) * 0.01
    w = torch.randn(conv_dim, width, device=dev, dtype=dt) * 0.1
    bias = torch.zeros(conv_dim, device=dev, dtype=dt)
    a_log = torch.randn(hv, device=dev, dtype=torch.float32)
    dt_bias = torch.randn(hv, device=dev, dtype=torch.float32)
    x = torch.randn(n, conv_dim, device=dev, dtype=dt)
    a = torch.randn(n, hv, device=dev, dtype=dt)
    b = torch.randn(n, hv, device=dev, dtype=dt)
    spec_idx = 1 + torch.arange(n * slots_per_req, device=dev, dtype=torch.int32)
    spec_idx = spec_idx.view(n, slots_per_req)
    plain_idx = spec_idx[:, 0].contiguous()
    qsl = torch.arange(n + 1, device=dev, dtype=torch.int32)
    accepted = torch.ones(n, device=dev, dtype=torch.int32)
    out = torch.zeros(n, hv, dv, device=dev, dtype=dt)

    def packed() -> None:
        for _ in range(layers):
            y = causal_conv1d_update(
                x, conv_state, w, bias, "silu",
                conv_state_indices=plain_idx, validate_data=False,
            )  # fmt: skip
            fused_recurrent_gated_delta_rule_packed_decode(
                mixed_qkv=y, a=a, b=b, A_log=a_log, dt_bias=dt_bias,
                scale=dk**-0.5, initial_state=ssm, out=out.unsqueeze(1),
                ssm_state_indices=plain_idx, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip

    def spec() -> None:
        for _ in range(layers):
            y = causal_conv1d_update(
                x, conv_state, w, bias, "silu",
                conv_state_indices=spec_idx[:, 0], num_accepted_tokens=accepted,
                query_start_loc=qsl, max_query_len=slots_per_req, validate_data=False,
            )  # fmt: skip
            q, k, v = torch.split(y, [key_dim, key_dim, value_dim], dim=-1)
            q = q.reshape(1, n, hk, dk).contiguous()
            k = k.reshape(1, n, hk, dk).contiguous()
            v = v.reshape(1, n, hv, dv).contiguous()
            o, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=a_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v,
                initial_state=ssm, inplace_final_state=True, cu_seqlens=qsl,
                ssm_state_indices=spec_idx, num_accepted_tokens=accepted,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            out.copy_(o.view(n, hv, dv))

    res: dict = {"batch": n, "layers": layers}
    for name, fn in (("packed", packed), ("spec", spec), ("packed2", packed)):
        ms = _graph_ms(fn, repeats)
        res[f"{name}_ms"] = round(statistics.median(ms), 3)
        res[f"{name}_spread_ms"] = [round(min(ms), 3), round(max(ms), 3)]
    return res


if __name__ == "__main__":
    main()
