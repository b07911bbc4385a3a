# SPDX-License-Identifier: Apache-2.0
"""GPU time of one DFlash draft step's GEMMs: bf16 weights against fp8 weights.

    python benchmarks/gpu/drafter_gemm.py OUT.jsonl [--requests 1,4] [--tau 6.35]
        [--config fixtures/shapes/qwen3.6-27b/drafter-config.json]

The drafter's GEMMs are its largest part of a step (27B-shaped pair, one request,
H100: 2.15 of the drafter's 2.48 ms, the LM head 0.85; docs/performance.md) and
read their weights once a step: bf16 weights cost twice the bytes of fp8. Before
the drafter gets an fp8 path, this says what it would save. Per ``--requests`` R,
one step's GEMMs at that batch (k = the config's block size - 1):

* ``fc``: the new context tokens (R x tau) from the target's hidden states of the
  drafter's target layers to its hidden size;
* per layer, the context K/V of the new context tokens, then q/k/v, o, gate/up and
  down over the block's query tokens (R x block size);
* ``lm_head``: the k draft positions (R x k) to the vocabulary.

Every GEMM has its own weights (as in the model: nothing stays in L2 between
layers), the whole list is captured in one CUDA graph and replayed; median and
spread of ``--repeats`` replays. Three variants: bf16 (``F.linear``), fp8 for all
of them, and fp8 with the LM head in bf16 (the head is the target's, shared:
an fp8 copy would cost its bytes again). fp8 is vLLM's own path for an fp8
checkpoint on sm90 (``scaled_fp8_quant`` of the activations per token, then
``cutlass_scaled_mm`` with per-channel weight scales), so the activation
quantisation is in the time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_CONFIG = (
    Path(__file__).resolve().parents[2]
    / "fixtures"
    / "shapes"
    / "qwen3.6-27b"
    / "drafter-config.json"
)


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int  # rows of the activation (tokens)
    k: int  # input features
    n: int  # output features

    @property
    def weight_bytes_bf16(self) -> int:
        return 2 * self.k * self.n


def step_gemms(config: dict, requests: int, tau: float) -> list[Gemm]:
    """One draft step's GEMMs at ``requests`` requests, in the model's order."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_width = config["num_attention_heads"] * head_dim
    kv_width = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    block = config.get("block_size", 16)
    targets = len(config.get("dflash_config", {}).get("target_layer_ids", [])) or 5
    context = max(1, round(requests * tau))  # accepted tokens + bonus, all requests
    queries = requests * block
    out = [Gemm("fc", context, targets * hidden, hidden)]
    for i in range(config["num_hidden_layers"]):
        out += [
            Gemm(f"layer{i}.context_kv", context, hidden, 2 * kv_width),
            Gemm(f"layer{i}.qkv", queries, hidden, q_width + 2 * kv_width),
            Gemm(f"layer{i}.o", queries, q_width, hidden),
            Gemm(f"layer{i}.gate_up", queries, hidden, 2 * inter),
            Gemm(f"layer{i}.down", queries, inter, hidden),
        ]
    out.append(Gemm("lm_head", requests * (block - 1), hidden, config["vocab_size"]))
    return out


class _Fp8:
    """fp8 weights with per-channel scales, vLLM's sm90 GEMM."""

    def __init__(self, w: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        self.ops = ops
        scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
        self.w_t = (w.float() / scale).to(torch.float8_e4m3fn).t()  # column-major
        self.scale = scale.reshape(1, -1).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = self.ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        return self.ops.cutlass_scaled_mm(xq, self.w_t, xs, self.scale, torch.bfloat16)


def _summary(times: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(times), 4),
        "min_ms": round(min(times), 4),
        "max_ms": round(max(times), 4),
    }


def _sequence_ms(fns, repeats: int) -> list[float]:
    """``fns`` in order, captured in one CUDA graph: ms per replay."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from gdn_paths import _graph_ms

    return _graph_ms(lambda: [f() for f in fns], repeats)


def run(config: dict, requests: int, tau: float, repeats: int) -> dict:
    gemms = step_gemms(config, requests, tau)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16, fp8, mixed = [], [], []
    for g in gemms:
        w = torch.randn(g.n, g.k, device=dev, dtype=torch.bfloat16, generator=gen)
        w *= g.k**-0.5
        x = torch.randn(g.m, g.k, device=dev, dtype=torch.bfloat16, generator=gen)
        q = _Fp8(w)
        bf16.append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        fp8.append(lambda x=x, q=q: q(x))
        mixed.append(bf16[-1] if g.name == "lm_head" else fp8[-1])
        if len(bf16) == 1:  # the fp8 path computes the same product (scales' layout)
            ref = bf16[0]().float()
            err = float((fp8[0]().float() - ref).norm() / ref.norm())
        del w
    rec: dict = {
        "requests": requests,
        "tau": tau,
        "gemms": len(gemms),
        "weight_gb_bf16": round(sum(g.weight_bytes_bf16 for g in gemms) / 1e9, 3),
        "lm_head_gb_bf16": round(gemms[-1].weight_bytes_bf16 / 1e9, 3),
        "fp8_rel_err": round(err, 4),  # fc, against bf16: a few percent for e4m3
    }
    for name, fns in (("bf16", bf16), ("fp8", fp8), ("fp8_bf16_head", mixed)):
        rec[name] = _summary(_sequence_ms(fns, repeats))
    rec["lm_head_bf16"] = _summary(_sequence_ms(bf16[-1:], repeats))
    rec["lm_head_fp8"] = _summary(_sequence_ms(fp8[-1:], repeats))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--requests", default="1,4")
    ap.add_argument("--tau", type=float, default=6.35)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    with open(args.config) as fh:
        config = json.load(fh)
    with open(args.out, "a") as fh:
        for r in (int(x) for x in args.requests.split(",")):
            rec = run(config, r, args.tau, args.repeats)
            print("RESULT", json.dumps(rec), flush=True)
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
