# SPDX-License-Identifier: Apache-2.0
"""Where a DFlash step's GPU time goes: a torch-profiler trace, and its summary.

    python benchmarks/gpu/step_trace.py MODE OUT_DIR [--conc 1] [--steps 24]
    python benchmarks/gpu/step_trace.py --analyse TRACE.json[.gz]   (any machine)

MODE as in perf_synthetic.py (``base``, ``stock``, ``plugin``, ``adaptive``; same models and
settings, no extra syncs: vLLM's own torch profiler, ``--profiler-config``).
The summary (``summary-MODE.json``) says, per engine step (one target forward):

- ``step_ms``: GPU time from one step's first kernel to the next one's;
- ``busy_ms``: the union of kernel intervals in it; ``idle_ms`` = the rest: the
  gaps between kernels (the host being late, or, inside CUDA graphs, the
  ~0.5 us between one kernel and the next);
- ``phase_ms``: kernel time per vLLM runner phase (``forward`` = target verify,
  ``draft`` = the whole proposer, ``sample``, ``preprocess``, ...), found by
  following each kernel to the host call that launched it;
- ``draft_kinds_ms``: the draft phase's kernel time per kind (attention, gemm,
  triton, ...) and how much of it a CUDA graph launched (without vLLM's scopes
  in the trace: all kernels after the target forward's graph, phase ``other``);
- ``gaps``: idle time grouped by the phases of the kernels on either side;
- ``untraced_split``: the untraced batch before the trace (``untraced_tok_s``):
  time to the first token, the decode phase per token, the tokens a verify step
  produced (``request_split``);
- ``untraced_steps``: the same batch's engine steps from ``VLLM_DFLASH_STEP_LOG``
  (``perf_synthetic.step_summary``: the prefill ("mixed") step, the decode steps
  per draft length, the slowest steps), and ``untraced_outside_ms``: the batch's
  wall time that no step covers (front end, request set-up and teardown).
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import os
import statistics
import time
from collections import defaultdict

PHASE_PREFIX = "gpu_model_runner: "
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attn" in n:
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")):
        return "gemm"
    if "triton" in n:
        return "triton"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if any(k in n for k in ("argmax", "reduce", "softmax", "sort", "topk")):
        return "reduce"
    return "other"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def analyse(events: list[dict], min_gap_us: float = 5.0) -> dict:
    """Per-step GPU accounting of a chrome trace written by torch.profiler."""
    ann = [
        e for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith(PHASE_PREFIX)
    ]  # fmt: skip
    launches = {
        e["args"]["correlation"]: e
        for e in events
        # cuBLASLt (nvjet) kernels launch through the driver API (cuLaunchKernelEx)
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
    }  # fmt: skip
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATS),
        key=lambda e: e["ts"],
    )
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for a in ann:
        by_tid[a.get("tid")].append(a)
    for lst in by_tid.values():
        lst.sort(key=lambda a: a["ts"])
    starts = {t: [a["ts"] for a in lst] for t, lst in by_tid.items()}

    def phase_of(k: dict) -> tuple[str, str]:
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None:
            return "unknown", ""
        lst = by_tid.get(launch.get("tid"), [])
        i = bisect.bisect_right(starts.get(launch.get("tid"), []), launch["ts"]) - 1
        while i >= 0:  # innermost annotation that contains the launch
            a = lst[i]
            if a["ts"] <= launch["ts"] <= a["ts"] + a["dur"]:
                return a["name"][len(PHASE_PREFIX) :], launch["name"]
            i -= 1
        return "other", launch["name"]

    # Without vLLM's scopes (VLLM_CUSTOM_SCOPES_FOR_PROFILING unset) the target
    # forward is still recognisable: the one graph launch with the most kernels.
    per_launch: dict[object, int] = defaultdict(int)
    for k in kernels:
        per_launch[k.get("args", {}).get("correlation")] += 1
    biggest = max(per_launch.values(), default=0)
    tagged = []
    for k in kernels:
        phase, api = phase_of(k)
        if not ann and biggest >= 50:
            big = per_launch[k.get("args", {}).get("correlation")] >= biggest // 2
            phase = "forward" if big else "other"
        tagged.append((k, phase, "Graph" in api))
    # A step starts at the first kernel of each run of "forward" kernels.
    step_starts = [
        i for i, (_, ph, _) in enumerate(tagged)
        if ph == "forward" and (i == 0 or tagged[i - 1][1] != "forward")
    ]  # fmt: skip
    steps = []
    for a, b in zip(step_starts[:-1], step_starts[1:], strict=True):
        window = tagged[a:b]
        t0, t1 = window[0][0]["ts"], tagged[b][0]["ts"]
        ivs = [(k["ts"], min(k["ts"] + k["dur"], t1)) for k, _, _ in window]
        phase_ms: dict[str, float] = defaultdict(float)
        kinds: dict[str, float] = defaultdict(float)
        draft_graph = 0.0
        by_kernel: dict[str, float] = defaultdict(float)
        gaps: dict[str, float] = defaultdict(float)
        end, prev_phase = float("-inf"), None
        for k, ph, graph in window:
            phase_ms[ph] += k["dur"] / 1000.0
            by_kernel[f"{ph}|{k['name'][:100]}"] += k["dur"] / 1000.0
            if ph in ("draft", "other"):
                kinds[kernel_kind(k["name"])] += k["dur"] / 1000.0
                if graph:
                    draft_graph += k["dur"] / 1000.0
            if prev_phase is not None and k["ts"] - end >= min_gap_us:
                gaps[f"{prev_phase}->{ph}"] += (k["ts"] - end) / 1000.0
            end, prev_phase = max(end, k["ts"] + k["dur"]), ph
        if t1 - end >= min_gap_us:
            gaps[f"{prev_phase}->next step"] += (t1 - end) / 1000.0
        busy = _union_ms(ivs)
        steps.append({
            "step_ms": (t1 - t0) / 1000.0, "busy_ms": busy, "idle_ms": (t1 - t0) / 1000.0 - busy,
            "phase_ms": dict(phase_ms), "draft_kinds_ms": dict(kinds),
            "draft_graph_ms": draft_graph, "gaps": dict(gaps),
            "kernels_ms": dict(by_kernel),
        })  # fmt: skip
    return {"steps": len(steps), "median": _median_step(steps), "per_step": steps}


def _median_step(steps: list[dict]) -> dict:
    if not steps:
        return {}
    out: dict = {}
    for key in ("step_ms", "busy_ms", "idle_ms", "draft_graph_ms"):
        out[key] = round(statistics.median(s[key] for s in steps), 4)
    for key in ("phase_ms", "draft_kinds_ms", "gaps"):
        names = sorted({n for s in steps for n in s[key]})
        out[key] = {
            n: round(statistics.median(s[key].get(n, 0.0) for s in steps), 4)
            for n in names
        }
    # kernel time per (phase, kernel name), the 80 largest: two traces diff by name
    names = {n for s in steps for n in s.get("kernels_ms", {})}
    med = {
        n: statistics.median(s["kernels_ms"].get(n, 0.0) for s in steps) for n in names
    }
    top = sorted(med.items(), key=lambda kv: -kv[1])[:80]
    out["kernels_ms"] = {n: round(v, 4) for n, v in top}
    return out


def run(
    mode: str,
    out_dir: str,
    conc: int,
    steps: int,
    root: str,
    pair: str = "dense",
    kv_cache_gib: float = 0.0,
    max_tokens: int = 768,
    wait: int = 0,
    gpu_util: float = 0.85,
) -> None:
    import random
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import perf_synthetic as ps

    if mode == "stock":
        os.environ["VLLM_PLUGINS"] = ""
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # runner phases in the trace
    trace_dir = os.path.join(out_dir, f"trace-{mode}")
    os.makedirs(trace_dir, exist_ok=True)
    # one line per engine step (no device sync): the untraced batch's steps
    steps_path = os.path.abspath(
        os.path.join(out_dir, f"steps-{pair}-{mode}-c{conc}.jsonl")
    )
    os.environ["VLLM_DFLASH_STEP_LOG"] = steps_path
    ps.write_models(root, pair)
    from vllm import LLM, SamplingParams

    llm = LLM(
        **ps.engine_kwargs(mode, root, 6.35, max(conc, 4), pair=pair, kv_cache_gib=kv_cache_gib,
                            gpu_util=gpu_util),
        profiler_config={
            "profiler": "torch", "torch_profiler_dir": trace_dir,
            "torch_profiler_with_stack": False, "ignore_frontend": True,
            "wait_iterations": wait, "warmup_iterations": 6,
            "active_iterations": steps,
        },
        disable_log_stats=False,  # request metrics and spec-decode counters
    )  # fmt: skip
    rng = random.Random(0)

    sp = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    # warm-up: shapes, graphs
    llm.generate(ps.random_prompts(rng, conc), sp, use_tqdm=False)
    before = ps.spec_counters(llm)
    t = time.time()
    outs = llm.generate(ps.random_prompts(rng, conc), sp, use_tqdm=False)
    untraced = time.time() - t
    split = request_split(outs, before, ps.spec_counters(llm))
    steps = ps.step_summary(steps_path, t, t + untraced)
    llm.start_profile()
    llm.generate(ps.random_prompts(rng, conc), sp, use_tqdm=False)
    llm.stop_profile()
    time.sleep(5)
    files = sorted(glob.glob(os.path.join(trace_dir, "*.json*")), key=os.path.getsize)
    summary = {
        "mode": mode,
        "pair": pair,
        "conc": conc,
        "untraced_tok_s": round(conc * max_tokens / untraced, 1),
        "untraced_s": round(untraced, 4),
        "untraced_split": split,
        "untraced_steps": steps,
        "untraced_outside_ms": outside_ms(untraced, steps),
    }
    if files:
        summary["trace"] = os.path.basename(files[-1])
        summary.update(analyse(_load(files[-1])))
    with open(os.path.join(out_dir, f"summary-{pair}-{mode}-c{conc}.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print("RESULT", json.dumps({k: v for k, v in summary.items() if k != "per_step"}))


def outside_ms(wall_s: float, steps: dict) -> float | None:
    """The part of a batch's wall time (seconds) that none of its engine steps
    (a ``step_summary``) covers, in ms: submitting the requests, the front end's
    output handling after the last step. None without step records."""
    if not steps:
        return None
    covered = steps["mixed"]["ms"] + sum(d["ms"] for d in steps["decode"].values())
    return round(1000 * wall_s - covered, 1)


def request_split(outs, before: dict, after: dict) -> dict:
    """Where one untraced batch's time went, from vLLM's request metrics: time to
    the first token (mean over requests), the decode phase (first to last token)
    and its seconds per generated token, and the tokens a verify step produced
    (1 + accepted drafts per draft step, from the spec-decode counters)."""
    ttft, decode, tokens = [], [], []
    for o in outs:
        m = o.metrics
        if m is None or not m.first_token_ts:
            continue
        ttft.append(m.first_token_latency)
        decode.append(m.last_token_ts - m.first_token_ts)
        tokens.append(len(o.outputs[0].token_ids) - 1)
    out: dict = {}
    if ttft:
        out["ttft_s"] = round(sum(ttft) / len(ttft), 4)
        out["decode_s"] = round(sum(decode) / len(decode), 4)
        out["decode_ms_per_token"] = round(1000 * sum(decode) / max(1, sum(tokens)), 3)
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0
    )
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0
    )
    if drafts:
        out["draft_steps"] = int(drafts)
        out["tokens_per_step"] = round(1 + accepted / drafts, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    # adaptive: "draft_length": "adaptive"; VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE=3
    # forces the verified length (e.g. the policy's choice at 64 requests)
    ap.add_argument("mode", nargs="?", choices=["base", "stock", "plugin", "adaptive"])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--conc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--root", default="/root/p8b-trace")
    ap.add_argument("--pair", choices=["dense", "hybrid"], default="dense")
    ap.add_argument(
        "--kv-cache-gib", type=float, default=0.0,
        help="fixed KV cache (no memory profiling: another engine shares the GPU)",
    )  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--gpu-util", type=float, default=0.85)
    ap.add_argument(
        "--wait", type=int, default=0,
        help="engine steps before the profiler's warm-up (past the prefill at large batches)",
    )  # fmt: skip
    ap.add_argument("--analyse", default=None, help="summarise an existing trace")
    args = ap.parse_args()
    if args.analyse:
        res = analyse(_load(args.analyse))
        print(json.dumps({k: v for k, v in res.items() if k != "per_step"}, indent=1))
        return
    run(
        args.mode,
        args.out_dir,
        args.conc,
        args.steps,
        args.root,
        args.pair,
        args.kv_cache_gib,
        args.max_tokens,
        args.wait,
        args.gpu_util,
    )


if __name__ == "__main__":
    main()
