# SPDX-License-Identifier: Apache-2.0
"""Run ``vllm.LLM`` once (greedy) and write outputs + spec-decode counters as JSON.

A separate process per configuration: env vars (VLLM_DFLASH_DISABLE,
VLLM_DFLASH_TRACE) are read when vLLM starts its processes.
"""

import argparse
import json
import os


def prompts(n: int = 8) -> list[list[int]]:
    """Deterministic token-id prompts of mixed lengths (5..40 tokens)."""
    out = []
    for i in range(n):
        length = 5 + (i * 5) % 36
        out.append([4 + (i * 37 + j * 11) % 500 for j in range(length)])
    return out


def shared_prefix_prompts(
    n: int = 8, block_size: int = 16, k: int = 4
) -> list[list[int]]:
    """One 2-block prefix, then own tokens up to the next block boundary; the last
    prompt stops ``k`` tokens short, so its ``k + 1``-token first query block ends
    on that boundary. All first query blocks reach position ``3 * block_size``."""
    prefix = [4 + (j * 13) % 500 for j in range(2 * block_size)]
    out = []
    for i in range(n):
        own = block_size - (k if i == n - 1 else 0)
        out.append(prefix + [4 + (i * 37 + j * 11) % 500 for j in range(own)])
    return out


def next_turn(prompt, output: list[int], i: int, turn: int):
    """The conversation's next prompt: the last prompt, the engine's answer and
    3..16 new user tokens (lengths vary, so turns start at and off block
    boundaries)."""
    user = [
        4 + (i * 7 + turn * 13 + j * 5) % 500 for j in range(3 + (i * 5 + turn) % 14)
    ]
    if isinstance(prompt, dict):
        return {
            **prompt,
            "prompt_token_ids": prompt["prompt_token_ids"] + output + user,
        }
    return prompt + output + user


def _request(prompt) -> dict:
    if not isinstance(prompt, dict):
        return {"prompt_token_ids": prompt}
    from tests.helpers.images import make_image

    request = {"prompt_token_ids": prompt["prompt_token_ids"]}
    if prompt.get("images"):
        request["multi_modal_data"] = {
            "image": [make_image(*spec) for spec in prompt["images"]]
        }
    return request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument(
        "--prompts",
        help="JSON file: a list of prompts, each a token-id list or "
        '{"prompt_token_ids": [...], "images": [[width, height, seed], ...]} '
        "(tests/helpers/images.py; the ids hold image_placeholder() per image)",
    )
    ap.add_argument(
        "--batches",
        action="store_true",
        help="--prompts holds a list of batches (lists of prompts): one generate "
        "call each, in order; results are concatenated, 'batch' says which",
    )
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--prompt-set", choices=("mixed", "shared-prefix"), default="mixed")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument(
        "--mm-limit",
        type=int,
        default=None,
        help="multimodal targets: limit_mm_per_prompt images (videos: 0)",
    )
    ap.add_argument(
        "--repeat",
        action="store_true",
        help="generate the same prompts a second time (prefix-cache hits); the "
        "second pass is appended to prompts/outputs/request_ids",
    )
    ap.add_argument(
        "--gdn-prefill-backend",
        default=None,
        help="gdn_prefill_backend; torch: the plugin's float32 GDN prefill (GPU fp32)",
    )
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="num_gpu_blocks_override: a small KV cache, so requests are preempted",
    )
    ap.add_argument(
        "--async-accepted-counts",
        action="store_true",
        help="CPU: vLLM's async-scheduling handling of the accepted counts in "
        "_prepare_inputs (tests/helpers/async_counts.py; worker in this process)",
    )
    ap.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="async_scheduling=False (GPU; the CPU backend is always synchronous)",
    )
    ap.add_argument(
        "--turns",
        type=int,
        default=1,
        help="multi-turn chat: each later turn re-sends every conversation (prompt "
        "+ the last output + new user tokens; see next_turn): prefix-cache hits at "
        "and off block boundaries, into the tokens the engine generated",
    )
    ap.add_argument(
        "--draft-length",
        choices=("fixed", "adaptive"),
        default=None,
        help='speculative_config "draft_length" (absent: vLLM\'s default, fixed)',
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    if args.tp > 1:
        kwargs["tensor_parallel_size"] = args.tp
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_blocks:
        kwargs["num_gpu_blocks_override"] = args.num_blocks
    if args.gdn_prefill_backend == "torch":
        # GPU float32: vLLM's GDN prefills are bf16/fp16 only. "triton" selects
        # forward_native, whose module-level kernel becomes the plugin's float32
        # chunked rule (as benchmarks/gpu/run_llm.py; the worker in this process).
        import vllm.model_executor.layers.mamba.gdn_linear_attn as gdn

        from vllm_dflash.cpu import gdn_ops

        gdn.fla_chunk_gated_delta_rule = gdn_ops.chunk_gated_delta_rule
        kwargs["gdn_prefill_backend"] = "triton"
        kwargs["distributed_executor_backend"] = "uni"
    elif args.gdn_prefill_backend:
        kwargs["gdn_prefill_backend"] = args.gdn_prefill_backend
    if args.async_accepted_counts:
        # the worker (spawned by vLLM-CPU) installs it: async_counts_site/
        site = os.path.join(os.path.dirname(__file__), "async_counts_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site, os.environ.get("PYTHONPATH", "")]
        )
        os.environ["VLLM_DFLASH_TEST_ASYNC_COUNTS"] = "1"
    if args.no_async_scheduling:
        kwargs["async_scheduling"] = False
    if args.mm_limit is not None:
        kwargs["limit_mm_per_prompt"] = {"image": args.mm_limit, "video": 0}
    llm = LLM(
        model=args.target,
        speculative_config=spec,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        enforce_eager=True,
        enable_prefix_caching=args.prefix_caching,
        disable_log_stats=False,
        seed=0,
        # Small blocks: sequences span many blocks, so a drafter KV cache that
        # recycled blocks outside the window (SlidingWindowSpec) would show.
        block_size=16,
        **kwargs,
    )
    if args.prompts:
        with open(args.prompts) as fh:
            ps = json.load(fh)
    elif args.prompt_set == "shared-prefix":
        ps = shared_prefix_prompts(args.num_prompts, k=args.k)
    else:
        ps = prompts(args.num_prompts)
    steps = _watch_steps(llm)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = ps if args.batches else [ps]
    if args.repeat:
        batches = batches + batches
    outs, images, batch_of = [], [], []
    for b, batch in enumerate(batches):
        for turn in range(args.turns):
            requests = [_request(p) for p in batch]
            done = llm.generate(requests, params)
            outs += done
            images += [list(p["images"]) if isinstance(p, dict) else [] for p in batch]
            batch_of += [b] * len(batch)
            batch = [
                next_turn(p, list(o.outputs[0].token_ids), i, turn)
                for i, (p, o) in enumerate(zip(batch, done, strict=True))
            ]
    counters, cache = {}, {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
            counters[m.name] = m.value
        elif (
            m.name.startswith("vllm:prefix_cache")
            and hasattr(m, "value")
            or m.name == "vllm:num_preemptions"
            and hasattr(m, "value")
        ):
            cache[m.name] = m.value
    result = {
        # as the engine saw them: an image placeholder expanded to its tokens
        "prompts": [list(o.prompt_token_ids) for o in outs],
        "images": images,
        "batch": batch_of,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "request_ids": [o.request_id for o in outs],
        "spec_decode": counters,
        "prefix_cache": cache,
        "scheduler": steps,
    }
    if args.draft_length == "adaptive":
        result["draft_lengths"] = _draft_lengths(llm)
    with open(args.out, "w") as fh:
        json.dump(result, fh)


def _watch_steps(llm) -> dict:
    """The scheduler's step budget and the most tokens one step scheduled (engine
    core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0); empty otherwise."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    sched = getattr(core, "scheduler", None)
    if sched is None:
        return {}
    seen = {"budget": sched.max_num_scheduled_tokens, "max_step_tokens": 0}
    schedule = sched.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seen["max_step_tokens"] = max(
            seen["max_step_tokens"], out.total_num_scheduled_tokens
        )
        return out

    sched.schedule = watched
    return seen


def _draft_lengths(llm) -> dict | None:
    """Scheduled steps per verified draft length, and scheduled requests of steps
    followed by a query / a context-only drafter pass (engine core in this process)."""
    from vllm_dflash.core.adaptive_draft_length import controller_of

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    ctl = controller_of(getattr(core, "scheduler", None))
    if ctl is None:
        return None
    return {
        "steps": {str(d): n for d, n in sorted(ctl.steps_by_length.items())},
        "rows": dict(ctl.rows_by_pass),
    }


if __name__ == "__main__":
    main()
