# SPDX-License-Identifier: Apache-2.0
"""Start-up cost of the plugin for a vLLM user who does not run DFlash.

Times, in one run and alternating (so machine noise hits both alike), each of:

* ``cli``: ``vllm serve --help`` (the API-server process parses its command line
  and loads general plugins);
* ``llm``: a Python process that builds ``vllm.LLM`` on the tiny target *without*
  speculative decoding, generates 8 tokens and exits;

once with the plugin (default) and once without any general plugin
(``VLLM_PLUGINS=`` set to an empty value, vLLM's own switch). Prints and writes
median / min / max seconds and the plugin/no-plugin ratio of medians.

    python benchmarks/startup.py --repeats 5 --out benchmarks/results/startup/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLM_SNIPPET = """
import os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True,
          max_num_seqs=2)
llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8))
"""


def timed(cmd: list[str], plugin: bool, case: str = "") -> float:
    env = dict(os.environ)
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # vLLM loads no general plugin
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{proc.stderr[-3000:]}")
    # The plugin's own start-up line ("vllm-dflash X on vLLM Y ..."), not any path
    # that merely contains the name (the tiny fixtures live under .cache/vllm-dflash).
    loaded = (
        re.search(r"vllm-dflash \S+ on vLLM", proc.stdout + proc.stderr) is not None
    )
    if case == "llm" and loaded != plugin:
        raise SystemExit(f"plugin loaded: {loaded}, wanted {plugin}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", default="cli,llm", help="comma list of cli, llm")
    args = ap.parse_args()
    from vllm_dflash.testing.tiny_models import ensure_tiny_models

    target = str(ensure_tiny_models().target)
    cases = {
        "cli": [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help"],
        "llm": [sys.executable, "-c", LLM_SNIPPET, target],
    }
    cases = {c: cmd for c, cmd in cases.items() if c in args.cases.split(",")}
    times: dict[str, dict[str, list[float]]] = {
        c: {"plugin": [], "no plugin": []} for c in cases
    }
    for c, cmd in cases.items():
        timed(cmd, True, c)  # warm the page cache and compiled bytecode once
        for i in range(args.repeats):
            order = (True, False) if i % 2 == 0 else (False, True)
            for plugin in order:
                key = "plugin" if plugin else "no plugin"
                times[c][key].append(timed(cmd, plugin, c))
    result = {"repeats": args.repeats, "cases": {}}
    for c, by in times.items():
        row = {
            k: {
                "median_s": round(statistics.median(v), 3),
                "min_s": round(min(v), 3),
                "max_s": round(max(v), 3),
                "all_s": [round(x, 3) for x in v],
            }
            for k, v in by.items()
        }
        row["ratio_of_medians"] = round(
            row["plugin"]["median_s"] / row["no plugin"]["median_s"], 3
        )
        result["cases"][c] = row
        print(
            f"{c:4} plugin {row['plugin']['median_s']:.2f} s "
            f"[{row['plugin']['min_s']:.2f}-{row['plugin']['max_s']:.2f}]  "
            f"no plugin {row['no plugin']['median_s']:.2f} s "
            f"[{row['no plugin']['min_s']:.2f}-{row['no plugin']['max_s']:.2f}]  "
            f"ratio {row['ratio_of_medians']:.3f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
