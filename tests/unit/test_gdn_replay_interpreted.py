# SPDX-License-Identifier: Apache-2.0
"""The GDN state replay's Triton kernels (the CUDA path) in Triton's interpreter.

``TRITON_INTERPRET=1`` runs ``@triton.jit`` kernels on the CPU (numpy, the same
pointer arithmetic, masks and loops). A subprocess imports
``gdn_replay_triton`` with the real ``triton`` (vLLM's CPU build hands out
placeholders) and runs ``verify`` and ``commit`` against the torch path (the CPU
backend's, which ``tests/gpu/test_gdn_replay_kernels.py`` holds to vLLM's own
kernel on a GPU): outputs, stored one-token states, ring flags and pending
records, committed states (counts of 0, 1, all, more than the ring holds), null
slots untouched; q/k/v as strided views of a packed tensor and each value-block
width. This checks the kernels' indexing without a GPU; compilation
and timing need one (tests/gpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl
import vllm.triton_utils as tu
tu.triton, tu.tl = triton, tl  # before the kernels' module is imported
from vllm_dflash.layers.ops import gdn_replay, gdn_replay_triton as gt

def case(h, hv, dk, dv, lens, slots, counts, seed, bv=None, views=False):
    gen = torch.Generator().manual_seed(seed)
    k_spec = max(lens) - 1
    layout = gdn_replay.ring_layout(k_spec, h, hv, dk, dv)
    t = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    if views:  # as the layer passes them: views of one packed qkv tensor
        mixed = torch.randn(t, 2 * h * dk + hv * dv, generator=gen)
        q, k, v = torch.split(mixed, [h * dk, h * dk, hv * dv], dim=-1)
        q = q.unflatten(-1, (h, dk)).unsqueeze(0)
        k = k.unflatten(-1, (h, dk)).unsqueeze(0)
        v = v.unflatten(-1, (hv, dv)).unsqueeze(0)
        assert not q.is_contiguous()
    else:
        q = torch.randn(1, t, h, dk, generator=gen)
        k = torch.randn(1, t, h, dk, generator=gen)
        v = torch.randn(1, t, hv, dv, generator=gen)
    a = torch.randn(t, hv, generator=gen)
    b = torch.randn(t, hv, generator=gen)
    gates = gdn_replay.Gates(torch.randn(hv, generator=gen) * 0.5,
                             torch.randn(hv, generator=gen), 20.0, True)
    slots = torch.tensor(slots, dtype=torch.int32)
    n_slots = int(slots.max()) + 2  # one slot no row uses
    state = torch.randn(n_slots, hv, dv, dk, generator=gen) * 0.1
    ring0 = torch.randn(n_slots, layout.length, generator=gen)
    s1, r1 = state.clone(), ring0.clone()
    s2, r2 = state.clone(), ring0.clone()
    o1 = gt.verify(q, k, v, a, b, gates, s1, r1, layout, cu, slots, dk ** -0.5, bv=bv)[0]
    o2 = gdn_replay.verify_torch(q[0], k[0], v[0], a, b, gates, dk ** -0.5, s2, r2,
                                 layout, cu, slots)
    res = {"o": 0.0, "state": 0.0, "flags": True, "records": 0.0, "commit": 0.0,
           "untouched": True}
    used = {int(s) for s in slots if s > 0}
    for i, n in enumerate(lens):
        lo, hi = int(cu[i]), int(cu[i + 1])
        s = int(slots[i])
        if s <= 0:
            continue
        res["o"] = max(res["o"], (o1[lo:hi] - o2[lo:hi]).abs().max().item())
        res["flags"] &= r1[s, 0].item() == r2[s, 0].item() == float(n > 1)
        if n > 1:  # pending records: the ring's first n records of each part
            keys1, values1, a1, b1 = layout.views(r1[s:s + 1])
            keys2, values2, a2, b2 = layout.views(r2[s:s + 1])
            for x, y in ((keys1, keys2), (values1, values2), (a1, a2), (b1, b2)):
                res["records"] = max(res["records"], (x[:, :n] - y[:, :n]).abs().max().item())
    res["state"] = (s1 - s2).abs().max().item()  # one-token rows stored, others kept
    for s in range(n_slots):
        if s not in used:
            res["untouched"] &= bool(torch.equal(s1[s], state[s]) and torch.equal(r1[s], ring0[s]))
    acc = torch.tensor(counts, dtype=torch.int32)
    gt.commit(s1, r1, layout, slots, acc, gates, bv=bv)
    gdn_replay.commit_torch(s2, r2, layout, slots, acc, gates)
    res["commit"] = (s1 - s2).abs().max().item()
    for s in range(n_slots):
        if s not in used:
            res["untouched"] &= bool(torch.equal(s1[s], state[s]))
    return res

out = [
    # grouped value heads, a one-token row, a null slot, counts 0 / all / clamped
    case(2, 4, 32, 64, [4, 1, 3, 2], [1, 2, 0, 4], [0, 1, 3, 9], 0),
    case(2, 4, 32, 64, [8, 8, 5], [3, 1, 2], [8, 1, 5], 1),
    # strided q/k/v and every value-block width ``value_block`` may pick
    case(2, 4, 32, 64, [4, 1, 3, 2], [1, 2, 0, 4], [0, 1, 3, 9], 3, bv=8, views=True),
    case(2, 4, 32, 64, [8, 8, 5], [3, 1, 2], [8, 1, 5], 4, bv=16, views=True),
    case(2, 4, 32, 64, [8, 2], [1, 2], [2, 2], 5, bv=32, views=True),
    # the Qwen3.6-27B head shapes (TP 1), one request verifying 16 tokens, views,
    # the width the policy picks for one request (8)
    case(16, 48, 128, 128, [16], [1], [6], 2, views=True),
]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_interpreted_verify_equals_the_torch_path(results):
    for res in results:
        assert res["o"] <= 1e-5, res
        assert res["state"] <= 1e-6, res  # one-token verifies store the state
        assert res["flags"], res
        assert res["records"] == 0.0, res  # raw inputs, stored as they came


def test_interpreted_commit_equals_the_torch_path(results):
    for res in results:
        assert res["commit"] <= 1e-5, res


def test_interpreted_kernels_skip_null_and_unused_slots(results):
    assert all(res["untouched"] for res in results), results
