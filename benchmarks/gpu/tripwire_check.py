# SPDX-License-Identifier: Apache-2.0
"""The positive control of dflash_jit_warmup's tripwire, on a GPU.

    VLLM_DFLASH_JIT_LOG=/path/jit.jsonl python benchmarks/gpu/tripwire_check.py

Installs the tripwire, warms one variant of a tiny kernel (not recorded), then
launches a new variant (recorded). Prints the JSON lines the log received and
exits 1 unless exactly the launched variant is there: an empty JIT log from a
served engine then means that nothing compiled, not that nothing listened.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from vllm_dflash.spec_decode.jit_warmup import install_tripwire


@triton.jit
def _fill(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs, mask=offs < n)


def main() -> int:
    path = os.environ["VLLM_DFLASH_JIT_LOG"]
    x = torch.zeros(64, dtype=torch.int32, device="cuda")
    install_tripwire()
    _fill.warmup(x, 64, BLOCK=32, grid=(1,))  # a warm-up: not recorded
    _fill[(1,)](x, 64, BLOCK=64)  # compiled while "serving": recorded
    torch.cuda.synchronize()
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            lines = f.read().splitlines()
    records = [json.loads(line) for line in lines]
    constants = [json.loads(r["specialization_data"])["constant_vals"] for r in records]
    print(json.dumps(constants))
    # Triton 3.6's repr is cut at the first tuple: read the constants instead
    ok = constants == [[64]] and x[:64].tolist() == list(range(64))
    print("tripwire", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
