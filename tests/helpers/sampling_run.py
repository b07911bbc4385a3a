# SPDX-License-Identifier: Apache-2.0
"""Run one vLLM engine on request groups with different SamplingParams, in ONE
``LLM.generate`` call, and write every request's output tokens as JSON.

    python tests/helpers/sampling_run.py --target T [--drafter D --k 7] \
        --groups groups.json --out out.json [--dtype float32] [--eager] ...

groups.json: ``[{"name", "n", "prompt" | "prompts", "params": {...SamplingParams},
"seed_base": int | null, "repeat": bool}]``. ``seed_base``: request i gets
``seed = seed_base + i``. Groups with ``repeat`` are generated again, alone, in two
more ``generate`` calls (same seeds): their outputs must repeat run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--groups", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: no chunking")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--uni", action="store_true", help="uni-process executor")
    ap.add_argument("--kv-cache-bytes", type=int, help="kv_cache_memory_bytes (GPU)")
    ap.add_argument("--cudagraph-mode", help="compilation_config cudagraph_mode")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--draft-length", choices=("fixed", "adaptive"))
    ap.add_argument(
        "--text-only", action="store_true", help="multimodal target: no image/video"
    )
    ap.add_argument(
        "--gdn-prefill",
        choices=("stock", "triton", "flashinfer", "torch"),
        default="stock",
        help="hybrid targets on CUDA: the GDN prefill kernel. stock: vLLM's choice "
        "(FlashInfer on sm90); triton: FLA (bf16/fp16 only); flashinfer: FlashInfer "
        "(sm90, bf16/fp16); torch: vllm_dflash/cpu/gdn_ops.py's fp32 chunked rule on "
        "the GPU (needs --uni: it is installed in this process)",
    )
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.uni:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    spec = None
    if args.drafter:
        spec = {
            "method": "dflash",
            "model": args.drafter,
            "num_speculative_tokens": args.k,
        }
        if args.draft_length:
            spec["draft_length"] = args.draft_length
    kwargs = {}
    if args.uni:
        kwargs["distributed_executor_backend"] = "uni"
    if args.kv_cache_bytes:
        # Several engines share one GPU: no memory profiling race between them.
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.cudagraph_mode:
        kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.text_only:
        kwargs["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    if args.gdn_prefill != "stock":
        # ChunkGatedDeltaRule: "triton" selects forward_native, which calls the
        # module's fla_chunk_gated_delta_rule (FLA asserts q.dtype != float32).
        backend = "flashinfer" if args.gdn_prefill == "flashinfer" else "triton"
        kwargs["additional_config"] = {"gdn_prefill_backend": backend}
    if args.gdn_prefill == "torch":
        if not args.uni:
            ap.error("--gdn-prefill torch needs --uni")
        import vllm.model_executor.layers.mamba.gdn_linear_attn as gdn

        from vllm_dflash.cpu import gdn_ops

        gdn.fla_chunk_gated_delta_rule = gdn_ops.chunk_gated_delta_rule
    try:
        import torch

        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    except ImportError:
        pass
    with open(args.groups) as fh:
        longest = max(
            len(p)
            for g in json.loads(fh.read())
            for p in (g.get("prompts") or [g["prompt"]])
        )
    # Default: room for every admitted request's whole prompt plus its k+1 verify
    # tokens, so no prompt is split over steps. A smaller value chunks prompts at
    # step boundaries (seeded requests included: vLLM-CPU needs the plugin's
    # cpu_seeded_partial_prefill there).
    kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens or (
        args.max_num_seqs * (longest + args.k + 1)
    )
    t0 = time.monotonic()
    llm = LLM(
        model=args.target,
        speculative_config=spec,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.eager,
        disable_log_stats=False,
        seed=0,
        skip_tokenizer_init=True,
        **kwargs,
    )
    init_s = time.monotonic() - t0
    with open(args.groups) as fh:
        groups = json.loads(fh.read())

    def requests(g: dict) -> tuple[list, list]:
        prompts = g.get("prompts") or [g["prompt"]] * g["n"]
        reqs, sps = [], []
        for i, p in enumerate(prompts[: g["n"]]):
            params = dict(g["params"])
            if g.get("seed_base") is not None:
                params["seed"] = g["seed_base"] + i
            reqs.append({"prompt_token_ids": p})
            sps.append(SamplingParams(ignore_eos=True, detokenize=False, **params))
        return reqs, sps

    all_reqs, all_sps, owner = [], [], []
    for g in groups:
        r, s = requests(g)
        all_reqs += r
        all_sps += s
        owner += [g["name"]] * len(r)
    t1 = time.monotonic()
    outs = llm.generate(all_reqs, all_sps, use_tqdm=False)
    gen_s = time.monotonic() - t1
    result: dict = {"init_s": init_s, "generate_s": gen_s, "groups": {}, "repeats": {}}
    for g in groups:
        result["groups"][g["name"]] = []
    for name, o in zip(owner, outs, strict=True):
        result["groups"][name].append(list(o.outputs[0].token_ids))
    for g in groups:
        if g.get("repeat"):
            reps = []
            for _ in range(2):
                r, s = requests(g)
                o = llm.generate(r, s, use_tqdm=False)
                reps.append([list(x.outputs[0].token_ids) for x in o])
            result["repeats"][g["name"]] = reps
    # vLLM refuses min_p / logit_bias with any speculative method: record what a
    # min_p request gets (accepted, or the error).
    try:
        llm.generate(
            [{"prompt_token_ids": groups[0].get("prompt") or [5, 6, 7]}],
            SamplingParams(temperature=1.0, min_p=0.2, max_tokens=1, detokenize=False),
            use_tqdm=False,
        )
        result["min_p_request"] = "accepted"
    except ValueError as e:
        result["min_p_request"] = f"refused: {e}"
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
            counters[m.name] = m.value
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "values"):
            counters[m.name] = list(m.values)
    result["spec_decode"] = counters
    # Patch states of this process (with --uni: the process that runs the worker).
    from vllm_dflash import registry

    result["patch_states"] = {n: r.state.value for n, r in registry._results.items()}
    with open(args.out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
