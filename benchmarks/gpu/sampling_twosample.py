# SPDX-License-Identifier: Apache-2.0
"""DFlash vs no speculation, same engine precision: two-sample chi-square per
sampling group and output token, from a ``sampling_check.py`` run's engine files.

Where the target's own precision (bf16) keeps both engines away from the float64
marginals, this asks the question that remains: does speculation change the
distribution the engine samples from?

    python benchmarks/gpu/sampling_twosample.py DIR/hybrid-bf16-graph [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.stats import chi2_sf  # noqa: E402

GROUPS = ("t0.6", "t1.0", "top_p", "top_k", "penalties", "seeded")


def two_sample(a: list[int], b: list[int]) -> dict:
    """Chi-square test of homogeneity; bins with < 5 expected are pooled."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    keys = set(ca) | set(cb)
    big = [k for k in keys if (ca[k] + cb[k]) * min(na, nb) / (na + nb) >= 5]
    cells = [(ca[k], cb[k]) for k in big]
    small = [k for k in keys if k not in big]
    if small:
        cells.append((sum(ca[k] for k in small), sum(cb[k] for k in small)))
    chi2 = 0.0
    for x, y in cells:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        chi2 += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(cells) - 1
    tv = 0.5 * sum(abs(ca[k] / na - cb[k] / nb) for k in keys)
    return {"n": [na, nb], "chi2": round(chi2, 2), "df": df,
            "p_value": chi2_sf(chi2, df) if df > 0 else 1.0, "tv": round(tv, 4)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "prefix", help="engine files PREFIX-dflash.json, PREFIX-no-spec.json"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = json.loads(Path(f"{args.prefix}-dflash.json").read_text())["groups"]
    base = json.loads(Path(f"{args.prefix}-no-spec.json").read_text())["groups"]
    rows = []
    for g in GROUPS:
        for t in range(len(spec[g][0])):
            r = two_sample([s[t] for s in spec[g]], [s[t] for s in base[g]])
            rows.append({"group": g, "token": t + 1, **r})
            print(f"{g:10s} token {t + 1}: {r}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
