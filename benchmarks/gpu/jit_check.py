# SPDX-License-Identifier: Apache-2.0
"""What DFlash engines compiled after their start-up warm-up (dflash_jit_warmup).

    python benchmarks/gpu/jit_check.py DIR [DIR...]

Reads, under each DIR (a device run's work dir, or its logs.tar.xz unpacked):

* ``*.jit-*.jsonl``: one line per Triton kernel variant a DFlash worker compiled
  (or loaded from the disk cache) after its warm-up (``VLLM_DFLASH_JIT_LOG``, set by
  perf_synthetic.py);
* ``*.log``: the warm-up's "compiled N spec-decode kernel variants" line and
  torch.compile's "Recompiling function" lines (``TORCH_LOGS=recompiles``).

Prints one JSON object: per JIT log, the kernels compiled while serving, and
whether any of them is one the warm-up covers (``covered_compiled``: must be
empty); per engine log, the warm-up lines and the recompilations of
update_num_computed_tokens_for_batch_change after the warm-up.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

# The kernels dflash_jit_warmup compiles at start-up (vllm_dflash/spec_decode/jit_warmup.py).
COVERED = {
    "copy_and_expand_dflash_inputs_kernel",
    "eagle_prepare_next_token_padded_kernel",
    "eagle_prepare_inputs_padded_kernel",
    "_compute_slot_mapping_kernel",
    "rejection_greedy_sample_kernel",
}
WARM = re.compile(
    r"DFlash: compiled (\d+) spec-decode kernel variants at start-up in ([\d.]+) s"
)
RECOMPILE = re.compile(r"Recompiling function (\w+)")


def jit_logs(root: Path) -> dict:
    out = {}
    for path in sorted(root.rglob("*.jit-*.jsonl")):
        names = collections.Counter()
        for line in path.read_text().splitlines():
            if line.strip():
                names[json.loads(line)["name"].rsplit(".", 1)[-1]] += 1
        out[str(path.relative_to(root))] = {
            "compiled_while_serving": dict(names),
            "covered_compiled": sorted(n for n in names if n in COVERED),
        }
    return out


def engine_logs(root: Path) -> dict:
    out = {}
    for path in sorted(root.rglob("*.log")):
        warm, after = [], collections.Counter()
        for line in path.read_text(errors="replace").splitlines():
            if m := WARM.search(line):
                warm.append({"variants": int(m.group(1)), "seconds": float(m.group(2))})
            elif warm and (m := RECOMPILE.search(line)):
                after[m.group(1)] += 1
        if warm:
            out[str(path.relative_to(root))] = {
                "warm_up": warm,
                "recompiled_after_warm_up": dict(after),
            }
    return out


def main(argv: list[str]) -> int:
    report = {}
    for arg in argv:
        root = Path(arg)
        report[arg] = {"jit_logs": jit_logs(root), "engine_logs": engine_logs(root)}
    print(json.dumps(report, indent=1))
    bad = any(
        j["covered_compiled"] for r in report.values() for j in r["jit_logs"].values()
    ) or any(
        e["recompiled_after_warm_up"].get("update_num_computed_tokens_for_batch_change")
        for r in report.values()
        for e in r["engine_logs"].values()
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
