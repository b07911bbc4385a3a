# SPDX-License-Identifier: Apache-2.0
"""Multi-turn chat on the Qwen3.6-27B-shaped hybrid pair (one GPU, dummy weights,
bf16, CUDA graphs, synthetic acceptance): no speculation + prefix caching, DFlash
without prefix caching, DFlash + prefix caching, one engine after the other.

    python benchmarks/gpu/multiturn_chat.py OUT.jsonl [--engines nospec_pc,dflash,dflash_pc]
        [--conversations 32] [--turns 4] [--system 2048] [--max-tokens 64] [--tau 6.35]

Every conversation starts with the same ``--system``-token system prompt, then a
user message of 64..127 tokens; each turn re-sends the whole conversation (the
previous prompt, the engine's answer, a new user message) for all conversations
at once (one ``LLM.generate`` a turn, greedy, ``--max-tokens`` each); ``--repeats``
workloads per engine, each with its own system prompt. One JSON line per engine:
end-to-end seconds of each workload, per turn seconds, output tokens
a second, time to first token (mean, p50, p90 over requests, from vLLM's request
metrics), prefix-cache queries and hits, spec-decode counters. DFlash uses
``draft_length: adaptive``, k = 15, ``rejection_sample_method: synthetic`` at
acceptance length ``--tau``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ENGINES = {
    "nospec_pc": ("base", True),
    "dflash": ("adaptive", False),
    "dflash_pc": ("adaptive", True),
}


def conversations(n: int, system: int, vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = vocab // 8, vocab * 7 // 8
    shared = [rng.randrange(lo, hi) for _ in range(system)]
    return [shared + user(rng, lo, hi) for _ in range(n)]


def user(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(rng.randrange(64, 128))]


def truncate_target(path: str, layers: int) -> None:
    """Diagnosis: the same shapes with the first ``layers`` target layers only
    (a shorter start-up); the drafter's target layers spread over them."""
    with open(path) as fh:
        cfg = json.load(fh)
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    draft = os.path.join(os.path.dirname(os.path.dirname(path)), "draft", "config.json")
    with open(draft) as fh:
        dcfg = json.load(fh)
    n = len(dcfg["dflash_config"]["target_layer_ids"])  # spread, distinct
    step = (layers - 3) / max(1, n - 1)
    dcfg["dflash_config"]["target_layer_ids"] = [round(1 + i * step) for i in range(n)]
    dcfg["num_target_layers"] = layers
    with open(draft, "w") as fh:
        json.dump(dcfg, fh)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_one(name: str, args: argparse.Namespace) -> dict:
    from benchmarks.gpu.perf_synthetic import engine_kwargs, pair_configs, write_models

    mode, prefix = ENGINES[name]
    root = "/root/q36-chat"
    write_models(root, "hybrid")
    if args.target_layers:
        truncate_target(f"{root}/target/config.json", args.target_layers)
    vocab = pair_configs("hybrid")[0].get("text_config", {}).get("vocab_size", 248320)
    kw = engine_kwargs(
        mode,
        root,
        args.tau,
        args.conversations,
        pair="hybrid",
        max_model_len=8192,
        enforce_eager=args.eager,
        cudagraph_mode=args.cudagraph_mode,
        kv_cache_gib=args.kv_cache_gib,
    )
    kw["enable_prefix_caching"] = prefix
    kw["disable_log_stats"] = False
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = random.Random(11)
    vocab_lo, vocab_hi = vocab // 8, vocab * 7 // 8
    # warm-up: one short request outside the system prompt (no cache entries shared)
    llm.generate([{"prompt_token_ids": [vocab_lo + 1] * 32}], params, use_tqdm=False)
    workload_s, turn_s, ttft, out_tokens, prompt_tokens = [], [], [], 0, 0
    for rep in range(args.repeats):
        # each repeat its own system prompt: its first turn finds nothing cached
        convs = conversations(args.conversations, args.system, vocab, seed=7 + rep)
        t_all = time.time()
        for _ in range(args.turns):
            t = time.time()
            outs = llm.generate(
                [{"prompt_token_ids": c} for c in convs], params, use_tqdm=False
            )
            turn_s.append(round(time.time() - t, 3))
            for i, o in enumerate(outs):
                toks = list(o.outputs[0].token_ids)
                out_tokens += len(toks)
                prompt_tokens += len(convs[i])
                if o.metrics is not None and o.metrics.first_token_latency:
                    ttft.append(o.metrics.first_token_latency)
                convs[i] = convs[i] + toks + user(rng, vocab_lo, vocab_hi)
        workload_s.append(round(time.time() - t_all, 2))
    total = sum(workload_s)
    counters = {}
    for m in llm.get_metrics():
        if hasattr(m, "value") and (
            m.name.startswith("vllm:spec_decode") or m.name.startswith("vllm:prefix")
        ):
            counters[m.name] = m.value
    q = counters.get("vllm:prefix_cache_queries", 0)
    h = counters.get("vllm:prefix_cache_hits", 0)
    return {
        "engine": name,
        "start_s": round(start_s, 1),
        "workload_s": workload_s,
        "turn_s": turn_s,
        "output_tok_s": round(out_tokens / total, 1),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "ttft_mean_s": round(statistics.mean(ttft), 4) if ttft else None,
        "ttft_p50_s": round(pct(ttft, 0.5), 4) if ttft else None,
        "ttft_p90_s": round(pct(ttft, 0.9), 4) if ttft else None,
        "prefix_hit_rate": round(h / q, 4) if q else None,
        "counters": counters,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "mamba_cache_mode": llm.llm_engine.vllm_config.cache_config.mamba_cache_mode,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--engines", default="nospec_pc,dflash,dflash_pc")
    ap.add_argument("--one", choices=sorted(ENGINES))
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tau", type=float, default=6.35)
    ap.add_argument("--repeats", type=int, default=2, help="workloads per engine")
    ap.add_argument(
        "--target-layers",
        type=int,
        default=0,
        help="diagnosis: keep the first N target layers (same shapes, faster start)",
    )
    ap.add_argument("--eager", action="store_true", help="enforce_eager")
    ap.add_argument("--cudagraph-mode", default="", help="e.g. PIECEWISE")
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=0.0,
        help="diagnosis: a fixed KV cache (vLLM then skips its memory profiling)",
    )
    args = ap.parse_args()
    if args.one:
        try:
            row = run_one(args.one, args)
        except Exception as e:  # recorded, the next engine still runs
            row = {"engine": args.one, "error": f"{type(e).__name__}: {e}"}
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        return 0
    for name in args.engines.split(","):
        cmd = [sys.executable, __file__, args.out, "--one", name]
        for flag in (
            "conversations",
            "turns",
            "system",
            "max_tokens",
            "tau",
            "repeats",
            "target_layers",
            "kv_cache_gib",
        ):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if args.eager:
            cmd.append("--eager")
        if args.cudagraph_mode:
            cmd += ["--cudagraph-mode", args.cudagraph_mode]
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path})
    return 0


if __name__ == "__main__":
    sys.exit(main())
