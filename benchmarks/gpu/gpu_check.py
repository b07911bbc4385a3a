# SPDX-License-Identifier: Apache-2.0
"""GPU correctness check of vllm-dflash on one GPU (FlashAttention backend).

    python benchmarks/gpu/gpu_check.py --out DIR [--budget SECONDS]

Builds the head_dim-128 tiny fixtures, runs one engine per configuration (base,
DFlash dense, DFlash sliding-window; eager and CUDA graphs; each backport disabled
in turn), and writes DIR/gpu_check.json:
  * lossless: DFlash greedy outputs vs the non-speculative run, batch 1/8/32;
  * drafts: traced drafts vs the float64 reference (exact match rate, and the rate
    once near-ties -- reference logit gap < 1% of its logit range -- are excused);
  * stock vs plugin: the same with each backport disabled.
Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUNS = [  # name, drafter, eager, disable, tensor_parallel_size
    ("base-eager", None, True, "", 1),
    ("dense-eager", "dense", True, "", 1),
    ("swa-eager", "swa", True, "", 1),
    ("dense-eager-stock40727", "dense", True, "dflash_aux_layer_shift", 1),
    ("swa-eager-stock40898", "swa", True, "dflash_sliding_window", 1),
    ("base-graph", None, False, "", 1),
    ("dense-graph", "dense", False, "", 1),
    ("swa-graph", "swa", False, "", 1),
    # Tensor parallel (2 GPUs): drafter heads split across ranks, fc replicated.
    ("base-graph-tp2", None, False, "", 2),
    ("dense-graph-tp2", "dense", False, "", 2),
    ("swa-graph-tp2", "swa", False, "", 2),
    # Stock vLLM (no plugin at all: VLLM_PLUGINS="") at TP=2, for the record.
    ("dense-graph-tp2-noplugin", "dense", False, "*", 2),
]


def base_run_for(name: str) -> str:
    """The non-speculative run with the same eager/graph mode and TP size."""
    mode = "eager" if "-eager" in name else "graph"
    tp = "-tp2" if "-tp2" in name else ""
    return f"base-{mode}{tp}"


def run_one(
    name, models, drafter, eager, disable, tp, out: Path, timeout: float
) -> dict:
    res_file, trace = out / f"{name}.json", out / f"{name}.trace.jsonl"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks/gpu/run_llm.py"),
        "--target",
        str(models.target),
        "--out",
        str(res_file),
    ]
    if drafter:
        cmd += ["--drafter", str(getattr(models, drafter))]
    if eager:
        cmd.append("--eager")
    if tp > 1:
        cmd += ["--tp", str(tp)]
    env = {
        **os.environ,
        "VLLM_DFLASH_DISABLE": "" if disable == "*" else disable,
        "VLLM_DFLASH_TRACE": str(trace),
    }
    if disable == "*":
        env["VLLM_PLUGINS"] = ""  # load no general plugin: stock vLLM
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    t0 = time.time()
    try:
        p = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = -9, f"TIMEOUT {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    (out / f"{name}.log").write_text(
        log if isinstance(log, str) else log.decode(errors="replace")
    )
    data = json.loads(res_file.read_text()) if rc == 0 and res_file.exists() else None
    records = (
        [json.loads(x) for x in trace.read_text().splitlines()]
        if trace.exists()
        else []
    )
    backend = sorted(
        {
            ln.split("Using ")[1].split(" ")[0]
            for ln in log.splitlines()
            if "Using " in ln and "backend" in ln
        }
    )
    return {
        "rc": rc,
        "wall_s": time.time() - t0,
        "data": data,
        "trace": records,
        "backends": backend,
    }


def compare_drafts(
    ref, data: dict, trace: list[dict], margin_frac: float = 0.01
) -> dict:
    seqs = {}
    for b in data["batches"].values():
        for rid, p, o in zip(b["request_ids"], b["prompts"], b["outputs"], strict=True):
            seqs[rid] = p + o
    tot = eq = excused = drafts = 0
    cache = {}
    for rec in trace:
        rid = rec["request_id"]
        full = seqs.get(rid) or next(
            (s for r, s in seqs.items() if rid.startswith(r + "-")), None
        )
        n = rec["num_tokens"]
        if (
            full is None
            or n > len(full)
            or full[:n][-len(rec["last_token_ids"]) :] != rec["last_token_ids"]
        ):
            continue
        key = id(full)
        if key not in cache:
            cache[key] = ref.features(full)
        k = len(rec["draft_token_ids"])
        want, logits = ref.draft(full[:n], k, feats=cache[key][: n - 1])
        drafts += 1
        for j, (a, b) in enumerate(zip(want, rec["draft_token_ids"], strict=True)):
            tot += 1
            if a == b:
                eq += 1
                continue
            row = logits[j]
            gap = float(row[a] - row[b])
            if gap <= margin_frac * float(row.max() - row.min()):
                excused += 1
    return {
        "drafts": drafts,
        "tokens": tot,
        "exact_match_rate": eq / max(tot, 1),
        "match_rate_excusing_near_ties": (eq + excused) / max(tot, 1),
    }


def lossless(base: dict, spec: dict) -> dict:
    out = {}
    for bs, b in base["batches"].items():
        s = spec["batches"][bs]
        same = sum(x == y for x, y in zip(b["outputs"], s["outputs"], strict=True))
        toks = sum(len(x) for x in b["outputs"])
        same_tok = sum(
            sum(p == q for p, q in zip(x, y, strict=True))
            for x, y in zip(b["outputs"], s["outputs"], strict=True)
        )
        out[bs] = {
            "identical_sequences": f"{same}/{len(b['outputs'])}",
            "token_agreement": same_tok / toks,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--models", type=Path, default=Path("/root/vllm-dflash-fixtures"))
    ap.add_argument("--runs", default="", help="comma-separated subset of run names")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    from vllm_dflash.testing.tiny_models import ensure_gpu_tiny_models

    models = ensure_gpu_tiny_models(args.models)
    runs = {}
    wanted = set(filter(None, args.runs.split(",")))
    for name, drafter, eager, disable, tp in RUNS:
        if wanted and name not in wanted:
            continue
        left = args.budget - (time.time() - t_start) - 60
        if left < 45:
            runs[name] = {"rc": None, "skipped": "time budget"}
            continue
        runs[name] = run_one(
            name, models, drafter, eager, disable, tp, args.out, min(left, 240)
        )
        print(
            f"[gpu_check] {name}: rc={runs[name]['rc']} {runs[name]['wall_s']:.0f}s {runs[name]['backends']}",
            flush=True,
        )

    import torch

    from tests.helpers.reference import Reference

    torch.set_default_device("cpu")
    refs = {}
    report = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "runs": {},
    }
    for name, r in runs.items():
        entry = {k: r.get(k) for k in ("rc", "wall_s", "backends", "skipped")}
        if r.get("data"):
            entry["spec_decode"] = r["data"]["spec_decode"]
            entry["init_s"] = r["data"]["init_s"]
            base = runs.get(base_run_for(name), {}).get("data")
            drafter = (
                "dense"
                if name.startswith("dense")
                else "swa"
                if name.startswith("swa")
                else None
            )
            if drafter and base:
                entry["lossless"] = lossless(base, r["data"])
            if drafter and r["trace"]:
                if drafter not in refs:
                    refs[drafter] = Reference.load(
                        models.target, getattr(models, drafter)
                    )
                entry["drafts_vs_reference"] = compare_drafts(
                    refs[drafter], r["data"], r["trace"]
                )
        report["runs"][name] = entry
        print(
            f"[gpu_check] {name}: {json.dumps({k: v for k, v in entry.items() if k != 'spec_decode'})}",
            flush=True,
        )
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
