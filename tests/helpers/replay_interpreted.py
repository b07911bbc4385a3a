# SPDX-License-Identifier: Apache-2.0
"""Run the GDN state replay's Triton kernels in Triton's interpreter on the CPU and
print, per case, how far they are from the torch path (one ``RESULT`` JSON line).

    python tests/helpers/replay_interpreted.py

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, and vLLM's CPU
build hands out placeholders for ``triton``: the real module is put in
``vllm.triton_utils`` before ``gdn_replay_triton`` is imported. A process of its
own, so no test sees the interpreted module.
"""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import vllm.triton_utils as tu  # noqa: E402

tu.triton, tu.tl = triton, tl  # before the kernels' module is imported

from vllm_dflash.layers.ops import gdn_replay  # noqa: E402
from vllm_dflash.layers.ops import gdn_replay_triton as gt  # noqa: E402


def case(
    h: int, hv: int, dk: int, dv: int,
    lens: list[int], slots: list[int], counts: list[int], seed: int,
    bv: int | None = None, views: bool = False,
) -> dict:  # fmt: skip
    """One batch: verify then commit, the Triton kernels against the torch path."""
    gen = torch.Generator().manual_seed(seed)
    k_spec = max(lens) - 1
    layout = gdn_replay.ring_layout(k_spec, h, hv, dk, dv)
    t = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    if views:  # as the layer passes them: views of one packed qkv tensor
        mixed = torch.randn(t, 2 * h * dk + hv * dv, generator=gen)
        q, k, v = gdn_replay.packed_qkv_views(mixed, h, hv, dk, dv)
        assert not q.is_contiguous()
    else:
        q = torch.randn(1, t, h, dk, generator=gen)
        k = torch.randn(1, t, h, dk, generator=gen)
        v = torch.randn(1, t, hv, dv, generator=gen)
    a = torch.randn(t, hv, generator=gen)
    b = torch.randn(t, hv, generator=gen)
    gates = gdn_replay.Gates(
        torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen), 20.0, True
    )
    slots = torch.tensor(slots, dtype=torch.int32)
    n_slots = int(slots.max()) + 2  # one slot no row uses
    state = torch.randn(n_slots, hv, dv, dk, generator=gen) * 0.1
    ring0 = torch.randn(n_slots, layout.length, generator=gen)
    s1, r1 = state.clone(), ring0.clone()
    s2, r2 = state.clone(), ring0.clone()
    o1 = gt.verify(q, k, v, a, b, gates, s1, r1, layout, cu, slots, dk**-0.5, bv=bv)[0]
    o2 = gdn_replay.verify_torch(
        q[0], k[0], v[0], a, b, gates, dk**-0.5, s2, r2, layout, cu, slots
    )
    res = {
        "o": 0.0,
        "state": 0.0,
        "flags": True,
        "records": 0.0,
        "commit": 0.0,
        "untouched": True,
    }
    used = {int(s) for s in slots if s > 0}
    for i, n in enumerate(lens):
        lo, hi = int(cu[i]), int(cu[i + 1])
        s = int(slots[i])
        if s <= 0:
            continue
        res["o"] = max(res["o"], (o1[lo:hi] - o2[lo:hi]).abs().max().item())
        res["flags"] &= r1[s, 0].item() == r2[s, 0].item() == float(n > 1)
        if n > 1:  # pending records: the ring's first n records of each part
            keys1, values1, a1, b1 = layout.views(r1[s : s + 1])
            keys2, values2, a2, b2 = layout.views(r2[s : s + 1])
            for x, y in ((keys1, keys2), (values1, values2), (a1, a2), (b1, b2)):
                res["records"] = max(
                    res["records"], (x[:, :n] - y[:, :n]).abs().max().item()
                )
    res["state"] = (s1 - s2).abs().max().item()  # one-token rows stored, others kept
    for s in range(n_slots):
        if s not in used:
            res["untouched"] &= bool(
                torch.equal(s1[s], state[s]) and torch.equal(r1[s], ring0[s])
            )
    acc = torch.tensor(counts, dtype=torch.int32)
    gt.commit(s1, r1, layout, slots, acc, gates, bv=bv)
    gdn_replay.commit_torch(s2, r2, layout, slots, acc, gates)
    res["commit"] = (s1 - s2).abs().max().item()
    for s in range(n_slots):
        if s not in used:
            res["untouched"] &= bool(torch.equal(s1[s], state[s]))
    return res


def main() -> None:
    out = [
        # grouped value heads, a one-token row, a null slot, counts 0 / all / clamped
        case(2, 4, 32, 64, [4, 1, 3, 2], [1, 2, 0, 4], [0, 1, 3, 9], 0),
        case(2, 4, 32, 64, [8, 8, 5], [3, 1, 2], [8, 1, 5], 1),
        # strided q/k/v and every value-block width ``value_block`` may pick
        case(
            2, 4, 32, 64, [4, 1, 3, 2], [1, 2, 0, 4], [0, 1, 3, 9], 3, bv=8, views=True
        ),
        case(2, 4, 32, 64, [8, 8, 5], [3, 1, 2], [8, 1, 5], 4, bv=16, views=True),
        case(2, 4, 32, 64, [8, 2], [1, 2], [2, 2], 5, bv=32, views=True),
        # the Qwen3.6-27B head shapes (TP 1), one request verifying 16 tokens, views
        # (32-wide value blocks: a quarter of the interpreted programs of width 8,
        # which the small cases cover)
        case(16, 48, 128, 128, [16], [1], [6], 2, bv=32, views=True),
    ]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
