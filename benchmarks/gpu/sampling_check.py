# SPDX-License-Identifier: Apache-2.0
"""GPU (H200) sampling check of vllm-dflash: distribution preservation + the fp32 crash.

    python benchmarks/gpu/sampling_check.py --out DIR [--stages crash,dense,pair,hybrid] [--n 1200]
    python benchmarks/gpu/sampling_check.py --out DIR --cpu-dry-run --n 40   # vLLM-CPU

Stages (all started at once, one engine per process, on one GPU; every engine gets
``kv_cache_memory_bytes`` so that concurrent engines do not race in memory profiling):

* ``crash``: the reported crash (tiny Qwen3 target, drafter [sliding, sliding, full],
  window 8, block 6, k = 5; 3000 identical 12-token prompts, temperature 1,
  max_tokens 2, max_num_seqs 32, float32 -> FLEX_ATTENTION, CUDA graphs), with
  ``CUDA_LAUNCH_BLOCKING=1``: with the plugin it must run (also greedy and with 16
  tokens); with ``dflash_flex_full_cudagraph`` disabled it must crash (stock defect).
  The variants that isolated the trigger (eager, bf16, dense drafter, no
  speculation, PIECEWISE) ran in a second call (results README).
* ``dense``: tests/helpers/sampling_check.py on the head_dim-128 tiny fixtures
  (random dense drafter), bf16, FLASH_ATTN, CUDA graphs; DFlash + no-spec engines.
* ``pair``: the same check on the CPU test's pair (``sampling_pair``: peaked target,
  drafter that always drafts one likely token), float32 (FLEX_ATTENTION), CUDA
  graphs: drafts accepted and rejected.
* ``hybrid``: the same check on the tiny Qwen3.5-architecture hybrid
  (``hybrid_sampling_pair`` on ``GPU_HYBRID``: GDN + gated attention, head sizes 128,
  M-RoPE, vision tower unused; lm_head scaled so that the drafted token X has
  marginal 0.25 at output token 2; oracle drafter with [sliding, sliding, full] layers, window 6, block 8), CUDA
  graphs, prefix caching off (refused with DFlash on hybrids), against the float64
  marginals of ``HybridTarget`` (float64 GDN recurrence). Two variants at once:
  ``hybrid-fp32-graph``: float32, with the GDN *prefill* on the plugin's torch chunked
  rule (vllm_dflash/cpu/gdn_ops.py, on the GPU; FLA's ``chunk_gated_delta_rule``
  asserts q.dtype != float32), uni-process engine; verification/decode GDN kernels,
  conv1d and attention are vLLM's CUDA ones. ``hybrid-bf16-graph``: bfloat16, every
  kernel vLLM's (GDN prefill: FlashInfer where it can run, i.e. with the carried
  prebuilt module, else FLA Triton; ``GDN_PREFILL`` overrides; the kernel vLLM
  logged is in the engine_ran checks as ``gdn_prefill``); its target
  computes in bf16, so a check can fail by precision, as ``dense`` showed at top-k:
  read a bf16 failure that the no-spec engine shares as precision, not DFlash.

Writes DIR/sampling_check.json (every check) and prints a summary; exit 0 when
every check holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import gdn_backend  # noqa: E402
from tests.helpers import sampling_check as sc  # noqa: E402

CRASH_PROMPT = [4 + (j * 11) % 500 for j in range(12)]
CRASH_VARIANTS = {
    # name: (dtype, eager, temperature, max_tokens, drafter, extra runner args, env)
    # The reported configuration, plugin as shipped (dflash_flex_full_cudagraph on):
    "fp32-graph-t1": ("float32", False, 1.0, 2, "swa-w8b6", [], {}),
    "fp32-graph-greedy": ("float32", False, 0.0, 2, "swa-w8b6", [], {}),
    "fp32-graph-t1-16tok": ("float32", False, 1.0, 16, "swa-w8b6", [], {}),
    # The same with the fix disabled: must crash (the stock vLLM defect).
    "fp32-graph-t1-stock": (
        "float32",
        False,
        1.0,
        2,
        "swa-w8b6",
        [],
        {"VLLM_DFLASH_DISABLE": "dflash_flex_full_cudagraph"},
    ),
}
EXPECT_CRASH = {"fp32-graph-t1-stock"}
KV_BYTES = str(
    2 << 30
)  # kv_cache_memory_bytes: engines share the GPU, no profiling race


def gpu_models(root: Path):
    from vllm_dflash.testing.tiny_models import (
        GPU_SWA,
        GPU_TARGET,
        build_drafter,
        ensure_gpu_tiny_models,
    )

    models = ensure_gpu_tiny_models(root)
    w8b6 = models.root / "drafter-swa-w8b6"
    if not (w8b6 / "config.json").exists():
        from dataclasses import replace

        spec = replace(GPU_SWA, name="drafter-swa-w8b6", sliding_window=8, block_size=6)
        build_drafter(w8b6, spec, GPU_TARGET)
    return models, w8b6


def crash_stage(models, w8b6: Path, work: Path) -> list[dict]:
    def one(name: str) -> dict:
        dtype, eager, temp, max_tokens, drafter, extra, env = CRASH_VARIANTS[name]
        gfile = work / f"crash-{name}.groups.json"
        gfile.write_text(json.dumps([{
            "name": "crash", "n": 3000, "prompt": CRASH_PROMPT,
            "params": {"temperature": temp, "max_tokens": max_tokens},
        }]))  # fmt: skip
        args = ["--k", "5", "--dtype", dtype, "--max-num-seqs", "32",
                "--gpu-memory-utilization", "0.05", "--kv-cache-bytes", KV_BYTES,
                *extra] + (["--eager"] if eager else [])  # fmt: skip
        t0 = time.monotonic()
        rc, data, log = sc.run_engine(
            models.target, {"swa-w8b6": w8b6, "dense": models.dense, None: None}[drafter], gfile,
            work / f"crash-{name}.json", args,
            env={"CUDA_LAUNCH_BLOCKING": "1", **env}, timeout=420,
        )  # fmt: skip
        (work / f"crash-{name}.log").write_text(log)
        errors = [
            ln for ln in log.splitlines()
            if "Error" in ln or "error" in ln or "File \"" in ln
        ][-60:]  # fmt: skip
        n_out = len(data["groups"]["crash"]) if data else 0
        ran = rc == 0 and n_out == 3000
        crashed = "CUDA error: an illegal memory access" in log
        ok = crashed if name in EXPECT_CRASH else ran
        return {"check": "stock_crash" if name in EXPECT_CRASH else "no_crash",
                "engine": name, "ok": ok, "crashed": crashed,
                "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                "outputs": n_out, "spec_decode": (data or {}).get("spec_decode"),
                "error_lines": errors}  # fmt: skip

    with ThreadPoolExecutor(len(CRASH_VARIANTS)) as ex:
        return list(ex.map(one, CRASH_VARIANTS))


def stat_stage(
    tag: str, target: Path, drafter: Path, work: Path, n: int, args: list[str],
    min_accept: float, prompt: list[int] | None = None, marginals=None,
) -> list[dict]:  # fmt: skip
    """``marginals``: a callable returning the exact marginals (default: the dense
    ``Target``'s, computed after the engines)."""
    from tests.helpers.marginals import Target

    prompt = prompt or sc.sampling_prompt()
    gs = sc.groups(n)
    gfile = work / f"{tag}.groups.json"
    gfile.write_text(json.dumps(sc.groups_json(prompt, gs, 16)))
    runs, info = {}, {}

    def engine(which: str):
        t0 = time.monotonic()
        rc, data, log = sc.run_engine(
            target, drafter if which == "dflash" else None, gfile,
            work / f"{tag}-{which}.json", args, timeout=480,
        )  # fmt: skip
        (work / f"{tag}-{which}.log").write_text(log)
        info[which] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1),
                       "gdn_prefill": gdn_backend.from_log(log),  # as vLLM logged it
                       "tail": log.splitlines()[-30:] if rc else []}  # fmt: skip
        if data:
            runs[which] = data

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(engine, ["dflash", "no-spec"]))
    checks = [{"check": "engine_ran", "engine": f"{tag}:{w}", "ok": i["rc"] == 0, **i}
              for w, i in info.items()]  # fmt: skip
    if len(runs) == 2:
        marg = marginals() if marginals else sc.exact(Target(target), prompt, gs)
        for c in sc.evaluate(gs, marg, runs, min_accept=min_accept):
            c["engine"] = f"{tag}:{c['engine']}"
            checks.append(c)
        checks.append({"check": "info", "engine": tag, "ok": True,
                       "spec_decode": runs["dflash"].get("spec_decode"),
                       "generate_s": {w: r["generate_s"] for w, r in runs.items()}})  # fmt: skip
    return checks


# Accepted / drafted tokens: X is accepted only as the first draft (~13% of first
# drafts in the CPU dry run; the other 6 drafts of a step are rejected), so ~1.8%.
MIN_ACCEPT_HYBRID = 0.005


def hybrid_stage(root: Path, work: Path, n: int, cpu: bool = False) -> list[dict]:
    """Both hybrid variants at once; the float64 marginals are computed meanwhile."""
    from tests.helpers.marginals import HybridTarget
    from vllm_dflash.testing import tiny_hybrid as th

    t0 = time.monotonic()
    prompt = sc.hybrid_prompt()
    # GPU: head sizes 128 (GPU_HYBRID, as gpu_check's hybrid runs); CPU dry run: the
    # CPU fixture (same architecture, smaller: its float64 marginals are cheap).
    specs = (
        (th.HYBRID, th.HYBRID_DRAFTER)
        if cpu
        else (th.GPU_HYBRID, th.GPU_HYBRID_DRAFTER)
    )
    pair_dir = root / ("sampling-hybrid-cpu-v1" if cpu else "sampling-hybrid-gpu-v1")
    target, drafter, x = sc.hybrid_sampling_pair(pair_dir, prompt, *specs)
    timing = {"pair_s": round(time.monotonic() - t0, 1)}
    common = ["--k", "7", "--no-prefix-caching", "--text-only"]
    if cpu:  # dry run on vLLM-CPU: eager, the plugin's CPU GDN ops, no variants
        variants = {"hybrid-fp32-cpu": ["--dtype", "float32", "--eager", *common]}
    else:
        gpu = ["--gpu-memory-utilization", "0.05", "--kv-cache-bytes", KV_BYTES]
        variants = {
            "hybrid-fp32-graph": ["--dtype", "float32", "--uni", "--gdn-prefill",
                                  "torch", *common, *gpu],
            "hybrid-bf16-graph": ["--dtype", "bfloat16", "--gdn-prefill",
                                  gdn_backend.choose() or "stock", *common, *gpu],
        }  # fmt: skip

    def exact():
        t = time.monotonic()
        m = sc.exact(HybridTarget(target), prompt, sc.groups(n))
        timing["marginals_s"] = round(time.monotonic() - t, 1)
        return m

    with ThreadPoolExecutor(1 + len(variants)) as ex:
        marg = ex.submit(exact)
        futs = {
            tag: ex.submit(
                stat_stage, tag, target, drafter, work, n, args, MIN_ACCEPT_HYBRID,
                prompt, marg.result,
            )
            for tag, args in variants.items()
        }  # fmt: skip
        checks = [c for f in futs.values() for c in f.result()]
        m = marg.result()
    checks.append({"check": "info", "engine": "hybrid", "ok": True,
                   "drafted_token": x, "seconds": round(time.monotonic() - t0, 1),
                   "pair": json.loads((pair_dir / "pair.json").read_text()),
                   **timing,
                   "pruned_mass": {g: max(v.pruned) for g, v in m.items()}})  # fmt: skip
    return checks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--stages", default="crash,dense,pair")
    ap.add_argument("--models", type=Path, default=Path("/root/fixtures"))
    ap.add_argument("--n", type=int, default=1200)
    ap.add_argument(
        "--cpu-dry-run", action="store_true",
        help="stage hybrid only, on vLLM-CPU (eager, float32): catches Python errors",
    )  # fmt: skip
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    stages = a.stages.split(",")
    jobs = {}
    if a.cpu_dry_run:
        report = {"hybrid": hybrid_stage(a.models, a.out, a.n, cpu=True)}
        (a.out / "sampling_check.json").write_text(json.dumps(report, indent=1))
        print(f"[sampling_check] hybrid: {sc.summary(report['hybrid'])}"[:3000])
        return 0 if all(c["ok"] for c in report["hybrid"]) else 1
    models, w8b6 = gpu_models(a.models)
    with ThreadPoolExecutor(4) as ex:
        if "crash" in stages:
            jobs["crash"] = ex.submit(crash_stage, models, w8b6, a.out)
        if "dense" in stages:
            jobs["dense"] = ex.submit(
                stat_stage, "dense-bf16-graph", models.target, models.dense, a.out,
                a.n, ["--dtype", "bfloat16", "--k", "7", "--gpu-memory-utilization", "0.05", "--kv-cache-bytes", KV_BYTES],
                0.0,
            )  # fmt: skip
        if "pair" in stages:
            target, drafter, _ = sc.sampling_pair(
                a.models / "sampling-pair-v1", sc.sampling_prompt()
            )
            jobs["pair"] = ex.submit(
                stat_stage, "pair-fp32-graph", target, drafter, a.out, a.n,
                ["--dtype", "float32", "--k", "7", "--gpu-memory-utilization", "0.05", "--kv-cache-bytes", KV_BYTES],
                0.02,
            )  # fmt: skip
        if "hybrid" in stages:
            jobs["hybrid"] = ex.submit(hybrid_stage, a.models, a.out, a.n)
        report = {}
        for name, fut in jobs.items():
            try:
                report[name] = fut.result()
            except Exception as e:  # keep the other stages' results
                report[name] = [{"check": "stage", "engine": name, "ok": False,
                                 "error": f"{type(e).__name__}: {e}"}]  # fmt: skip
    (a.out / "sampling_check.json").write_text(json.dumps(report, indent=1))
    ok = True
    for name, checks in report.items():
        print(f"[sampling_check] {name}: {sc.summary(checks)}"[:3000])
        ok &= all(c["ok"] for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
