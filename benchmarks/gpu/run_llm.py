# SPDX-License-Identifier: Apache-2.0
"""One vLLM engine on the GPU: greedy generation for several batch sizes.

Writes JSON: outputs per batch size, spec-decode counters, engine init time, and
per drafter attention layer its KV-cache spec and attention window (from the
worker, through ``collective_rpc``). Run one configuration per process (env vars
such as VLLM_DFLASH_DISABLE and VLLM_DFLASH_TRACE are read when vLLM starts).
"""

import argparse
import json
import os
import time


def prompts(n: int, vocab: int = 500, min_len: int = 8) -> list[list[int]]:
    """Token ids 4..503: above the fixtures' special tokens (0..3) and below the
    hybrid fixture's vision tokens (504..507; tiny_hybrid.IMAGE_ID). Lengths
    ``min_len`` .. ``min_len + 89``; batch n's prompts open batch n+1's."""
    return [
        [4 + (i * 37 + j * 11) % vocab for j in range(min_len + (i * 13) % 90)]
        for i in range(n)
    ]


def drafter_kv_report(worker) -> dict:
    """Per drafter attention layer: KV-cache spec class and the impl's window."""
    runner = worker.model_runner
    specs = {}
    for group in runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            specs[name] = type(group.kv_cache_spec).__name__
    drafter = getattr(runner, "drafter", None)
    out = {}
    if drafter is None:
        return out
    for _, mod in drafter.model.named_modules():
        if hasattr(mod, "impl") and hasattr(mod, "layer_name"):
            win = getattr(mod.impl, "sliding_window", None)
            out[mod.layer_name] = {
                "kv_spec": specs.get(mod.layer_name),
                "window": list(win) if isinstance(win, tuple) else win,
                "impl": type(mod.impl).__name__,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft-length", choices=("fixed", "adaptive"), default=None)
    ap.add_argument(
        "--kv-cache-gib", type=float, default=0.0,
        help="fixed KV cache size (skips vLLM's memory profiling: engines sharing a GPU)",
    )  # fmt: skip
    ap.add_argument(
        "--no-prefix-caching", action="store_true",
        help="hybrid targets: DFlash + prefix caching is refused there",
    )  # fmt: skip
    ap.add_argument(
        "--min-prompt-len", type=int, default=8,
        help="shortest prompt (e.g. above a hybrid target's 304-token block, so that "
        "prefix caching can hit a whole block)",
    )  # fmt: skip
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument(
        "--sync-scheduling", action="store_true",
        help="async_scheduling=False (vLLM's synchronous scheduler)",
    )  # fmt: skip
    ap.add_argument(
        "--prefix-caching", action="store_true",
        help="enable_prefix_caching=True (vLLM 0.20.1 leaves it off for hybrid targets)",
    )  # fmt: skip
    ap.add_argument(
        "--mm-limit", type=int, default=None,
        help="multimodal targets: images per prompt (videos: 0); 0 = text only",
    )  # fmt: skip
    ap.add_argument(
        "--gdn-prefill-backend", default=None,
        help="hybrid targets: gdn_prefill_backend (flashinfer|triton); default: vLLM's "
        "choice (FlashInfer on sm90). gpu_check passes triton where flashinfer cannot "
        "run (benchmarks/gpu/gdn_backend.py). torch: float32 GDN prefill on "
        "vllm_dflash/cpu/gdn_ops.py's chunked rule (FLA's asserts q.dtype != float32; "
        "FlashInfer's is bf16/fp16), installed in this process, so the engine runs "
        "uni-process; the verify/decode GDN kernels stay vLLM's",
    )  # fmt: skip
    args = ap.parse_args()
    # collective_rpc with a function (the drafter KV report) pickles it by value.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    torch_prefill = args.gdn_prefill_backend == "torch"
    if torch_prefill:  # engine core and worker in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    extra = {}
    if args.no_prefix_caching:
        extra["enable_prefix_caching"] = False
    if args.prefix_caching:
        extra["enable_prefix_caching"] = True
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.sync_scheduling:
        extra["async_scheduling"] = False
    if torch_prefill:
        # "triton" selects ChunkGatedDeltaRule.forward_native, which calls the
        # module-level fla_chunk_gated_delta_rule: replaced here (harness only).
        import vllm.model_executor.layers.mamba.gdn_linear_attn as gdn

        from vllm_dflash.cpu import gdn_ops

        gdn.fla_chunk_gated_delta_rule = gdn_ops.chunk_gated_delta_rule
        extra["gdn_prefill_backend"] = "triton"
        extra["distributed_executor_backend"] = "uni"
    elif args.gdn_prefill_backend:
        extra["gdn_prefill_backend"] = args.gdn_prefill_backend
    if args.mm_limit is not None:
        extra["limit_mm_per_prompt"] = {"image": args.mm_limit, "video": 0}

    spec = None
    if args.drafter:
        spec = {
            "method": "dflash",
            "model": args.drafter,
            "num_speculative_tokens": args.k,
        }
        if args.draft_length:
            spec["draft_length"] = args.draft_length
    t0 = time.time()
    llm = LLM(
        model=args.target, speculative_config=spec, dtype=args.dtype, max_model_len=1024,
        enforce_eager=args.eager, gpu_memory_utilization=0.3, seed=0, max_num_seqs=args.max_num_seqs,
        disable_log_stats=False, tensor_parallel_size=args.tp,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) or None, **extra,
    )  # fmt: skip
    init_s = time.time() - t0
    result = {"init_s": init_s, "batches": {},
              "gdn_prefill_requested": args.gdn_prefill_backend or "vllm-default"}  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        ps = prompts(bs, min_len=args.min_prompt_len)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
        result["batches"][str(bs)] = {
            "prompts": ps,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "request_ids": [o.request_id for o in outs],
        }
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:spec_decode", "vllm:prefix_cache")) and hasattr(
            m, "value"
        ):
            counters[m.name] = m.value
    result["spec_decode"] = counters
    if args.drafter:
        try:
            result["kv"] = llm.collective_rpc(drafter_kv_report)[0]
        except Exception as e:  # the report is evidence, not a reason to lose the run
            result["kv_error"] = f"{type(e).__name__}: {e}"
    with open(args.out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
