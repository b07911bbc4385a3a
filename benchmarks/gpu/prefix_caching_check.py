# SPDX-License-Identifier: Apache-2.0
"""DFlash + prefix caching on the tiny hybrid pair on a GPU, float32: the
workload of tests/e2e/test_hybrid_prefix_caching.py (ten conversations, two
turns, the batch twice; a 48-block KV cache for preemption).

Runs tests/helpers/offline_run.py once per run named in PREFIX_RUNS (default:
no speculation; DFlash + prefix caching; the same with a 48-block KV cache; the
same with dflash_hybrid_mamba_no_eagle_margin and its refusal disabled; the same
with dflash_align_accepted_counts_order disabled; the same with synchronous
scheduling) and writes one
JSON summary plus each run's data and trace, so the drafts can be replayed on
the float64 reference on another machine:

    python benchmarks/gpu/prefix_caching_check.py OUT_DIR
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

from tests.e2e.test_hybrid_prefix_caching import (  # noqa: E402
    BUDGET,
    PATCH,
    REFUSAL,
    SMALL_CACHE_BLOCKS,
    _batch,
)
from vllm_dflash.testing.trained_hybrid import ensure_trained_hybrid  # noqa: E402

RUNS = {
    "no_spec": ((), ()),
    "dflash": (("--prefix-caching",), ()),
    "preempted": (("--prefix-caching", "--num-blocks", str(SMALL_CACHE_BLOCKS)), ()),
    "stock": (("--prefix-caching",), (PATCH, REFUSAL)),
    # red check: async scheduling (vLLM's default on CUDA) without the fix of the
    # accepted counts' row order; the same engine with synchronous scheduling
    "unfixed": (
        ("--prefix-caching",),
        ("dflash_align_accepted_counts_order", REFUSAL),
    ),
    "sync": (("--prefix-caching", "--no-async-scheduling"), ()),
    # diagnosis: DFlash without prefix caching
    "dflash_no_pc": ((), ()),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = ensure_trained_hybrid(out / "fixtures")
    prompts = out / "conversations.json"
    prompts.write_text(json.dumps(_batch()))
    summary: dict = {}
    names = os.environ.get(
        "PREFIX_RUNS", "no_spec,dflash,preempted,stock,unfixed,sync"
    ).split(",")
    for name, (extra, disable) in RUNS.items():
        if name not in names:
            continue
        cmd = [
            sys.executable,
            str(ROOT / "tests/helpers/offline_run.py"),
            "--target", str(models.target),
            "--prompts", str(prompts),
            "--repeat", "--turns", "2", "--mm-limit", "1",
            "--max-num-batched-tokens", str(BUDGET),
            "--out", str(out / f"{name}.json"),
            *extra,
        ]  # fmt: skip
        if name != "no_spec":
            cmd += ["--drafter", str(models.drafter)]
        # float32: vLLM's GDN prefills are bf16/fp16 only
        cmd += ["--gdn-prefill-backend", "torch"]
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_DFLASH_TRACE": str(out / f"{name}.jsonl"),
            "VLLM_DFLASH_DISABLE": ",".join(disable),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
        }
        t0 = time.time()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        summary[name] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
        if rc == 0:
            data = json.loads((out / f"{name}.json").read_text())
            summary[name].update(data["prefix_cache"], **data["spec_decode"])
    base = out / "no_spec.json"
    truth = json.loads(base.read_text())["outputs"] if base.exists() else None
    for name in names[1:]:
        path = out / f"{name}.json"
        if truth is not None and path.exists():
            outs = json.loads(path.read_text())["outputs"]
            summary[name]["diverged"] = [
                i for i, (a, b) in enumerate(zip(truth, outs, strict=True)) if a != b
            ]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("[prefix_caching_check]", json.dumps(summary))


if __name__ == "__main__":
    main()
