# SPDX-License-Identifier: Apache-2.0
"""List the Triton kernels compiled into a cache directory, oldest first.

    TRITON_CACHE_DIR=/tmp/tc python3 benchmarks/gpu/perf_synthetic.py ...
    python3 benchmarks/gpu/triton_cache_list.py /tmp/tc > kernels.jsonl

One JSON line per compiled kernel: the wall time its metadata was written (epoch
seconds, to line up with ``VLLM_DFLASH_STEP_LOG``'s ``t``), the kernel's name and
its specialisation (constants and the arguments Triton specialised on). Kernels
written after an engine's start-up were compiled while it served requests: a
step that waited for them is slower the first time its shapes occur.
"""

import json
import os
import sys


def main() -> None:
    root = sys.argv[1]
    rows = []
    for d in os.listdir(root):
        path = os.path.join(root, d)
        for f in os.listdir(path) if os.path.isdir(path) else ():
            if not f.endswith(".json") or f.startswith("__grp__"):
                continue
            full = os.path.join(path, f)
            try:
                with open(full) as fh:
                    meta = json.load(fh)
            except (OSError, ValueError):
                continue
            rows.append(
                {
                    "t": round(os.path.getmtime(full), 3),
                    "name": meta.get("name"),
                    "constants": str(meta.get("constants", ""))[:300],
                    "spec": str(meta.get("attrs", meta.get("specialization", "")))[
                        :300
                    ],
                }
            )
    for row in sorted(rows, key=lambda r: r["t"]):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
