# SPDX-License-Identifier: Apache-2.0
"""PNG plots of the JSON results kept under benchmarks/results/ (needs matplotlib).

    python benchmarks/plot_results.py benchmarks/results/h200x2-2026-11-30-122acc0

Writes next to the inputs: perf.png (tokens/s vs concurrency, every run as a
point, mean as a line), swa_context.png (draft milliseconds per step vs context
length) and step_profile.png (where a DFlash step's time goes), plus
perf_summary.json (median/mean per mode and plugin/stock ratios), for whichever
of perf.jsonl / swa_context.jsonl exist there; step_trace.png (median GPU time
per runner phase and idle, one bar per step_trace-*.json summary);
acceptance.png for a CPU acceptance benchmark (acceptance.json); and for each
call*-perf*.jsonl with no-speculation rows, <stem>-speedup.png: every DFlash
batch's tokens/s over the mean of the no-speculation batches at its concurrency
(points: batches, line: mean; the dashed line is 1.0).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _save_log2(
    fig, ax, out: Path, xlabel: str, ylabel: str, title: str, legend: int
) -> None:
    """Log2 x axis, labels, legend, grid; write the PNG."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_perf(rows: list[dict], out: Path) -> None:
    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("tag") == "profile":
            continue
        series[f"{r['mode']} TP={r.get('tp', 1)}"][r["conc"]].append(r["tok_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_conc in sorted(series.items()):
        xs = sorted(by_conc)
        means = [sum(by_conc[c]) / len(by_conc[c]) for c in xs]
        (line,) = ax.plot(xs, means, marker="o", label=name)
        for c in xs:
            ax.scatter([c] * len(by_conc[c]), by_conc[c], s=10, color=line.get_color())
    _save_log2(fig, ax, out, "concurrency", "output tokens/s",
               "Synthetic acceptance 6.35, k=15 (points: runs, line: mean)", legend=8)  # fmt: skip


def _stacked_bars(
    ax, bars: dict[str, dict[str, float]], order: list[str]
) -> list[float]:
    """One bar per BARS key, stacked by part in ORDER; returns the bar totals."""
    bottom = [0.0] * len(bars)
    for part in order:
        vals = [parts.get(part, 0.0) for parts in bars.values()]
        ax.bar(list(bars), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    return bottom


def plot_profile(rows: list[dict], out: Path) -> None:
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return
    sections = sorted({k for r in prof for k in r["profile"]["mean_ms"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    _stacked_bars(
        ax, {f"conc {r['conc']}": r["profile"]["mean_ms"] for r in prof}, sections
    )
    ax.set_ylabel("ms per step (device-synchronised sections)")
    ax.set_title("One DFlash step (vllm-dflash, H200)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_speedup(rows: list[dict], out: Path, title: str) -> None:
    base: dict[int, list[float]] = defaultdict(list)
    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "tok_s" not in r:
            continue
        if r["mode"] == "base":
            base[r["conc"]].append(r["tok_s"])
        else:
            series[r["mode"]][r["conc"]].append(r["tok_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_conc in sorted(series.items()):
        xs = [c for c in sorted(by_conc) if base.get(c)]
        ratios = {
            c: [t / (sum(base[c]) / len(base[c])) for t in by_conc[c]] for c in xs
        }
        means = [sum(ratios[c]) / len(ratios[c]) for c in xs]
        (line,) = ax.plot(xs, means, marker="o", label=name)
        for c in xs:
            ax.scatter([c] * len(ratios[c]), ratios[c], s=12, color=line.get_color())
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    _save_log2(fig, ax, out, "concurrency", "DFlash / no speculation (tokens/s)",
               title, legend=8)  # fmt: skip


def summarise_perf(rows: list[dict]) -> dict:
    """Per concurrency: median/mean tokens/s per mode and plugin/stock ratios."""
    from statistics import mean, median

    by: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("tag") != "profile" and r.get("tp", 1) == 1:
            by[r["conc"]][r["mode"]].append(r["tok_s"])
    out = {}
    for conc, modes in sorted(by.items()):
        row = {m: {"runs": len(v), "median": median(v), "mean": round(mean(v), 1),
                   "min": min(v), "max": max(v)} for m, v in sorted(modes.items())}  # fmt: skip
        if "stock" in modes and "plugin" in modes:
            row["plugin_over_stock_median"] = round(
                row["plugin"]["median"] / row["stock"]["median"], 4
            )
            row["plugin_over_stock_mean"] = round(
                row["plugin"]["mean"] / row["stock"]["mean"], 4
            )
        out[str(conc)] = row
    return out


def plot_swa(rows: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, batch in sorted({(r["variant"], r.get("batch", 1)) for r in rows}):
        rs = sorted(
            (r for r in rows if r["variant"] == variant and r.get("batch", 1) == batch),
            key=lambda r: r["context"],
        )
        xs = [r["context"] for r in rs]
        label = f"{variant}, {batch} req"
        ax.plot(xs, [r["sections_ms"]["draft_forward"] for r in rs], marker="o",
                label=f"{label}: draft forward")  # fmt: skip
        ax.plot(xs, [r["sections_ms"]["context_kv"] for r in rs], marker="s",
                linestyle="--", label=f"{label}: context K/V")  # fmt: skip
    _save_log2(fig, ax, out, "context tokens", "ms per drafting step",
               "Qwen3.6-27B-DFlash-shaped drafter (4 sliding + 1 full)", legend=6)  # fmt: skip


def plot_acceptance(data: dict, out: Path) -> None:
    runs = data["runs"]
    names = list(runs)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    a1.bar(names, [runs[n]["acceptance_length"] or 1.0 for n in names])
    a1.set_ylabel("mean acceptance length (no spec = 1)")
    a2.bar(names, [runs[n]["output_tokens_per_s"] for n in names], color="tab:orange")
    a2.set_ylabel("output tokens/s")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"Trained tiny drafters, vLLM {data.get('vllm', '')} CPU backend, "
                 f"k={data.get('num_speculative_tokens')}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_step_trace(summaries: dict[str, dict], out: Path) -> None:
    """Stacked bars: median GPU ms per runner phase, plus idle, per trace summary."""
    order = ["forward", "postprocess", "sample", "draft", "preprocess"]
    seen = {p for s in summaries.values() for p in s["median"]["phase_ms"]}
    phases = [p for p in order if p in seen] + sorted(seen - set(order))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    bars = {
        name: {**s["median"]["phase_ms"], "idle": s["median"]["idle_ms"]}
        for name, s in summaries.items()
    }
    for x, total in enumerate(_stacked_bars(ax, bars, [*phases, "idle"])):
        ax.text(x, total, f"{total:.2f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GPU ms per engine step (median, profiler trace)")
    ax.set_title("One engine step at concurrency 1, by runner phase")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    root = Path(sys.argv[1])
    if (root / "perf.jsonl").exists():
        rows = _jsonl(root / "perf.jsonl")
        plot_perf(rows, root / "perf.png")
        plot_profile(rows, root / "step_profile.png")
        summary = json.dumps(summarise_perf(rows), indent=1)
        (root / "perf_summary.json").write_text(summary + "\n")
    if (root / "swa_context.jsonl").exists():
        plot_swa(_jsonl(root / "swa_context.jsonl"), root / "swa_context.png")
    traces = sorted(root.glob("step_trace-*.json"))
    if traces:
        plot_step_trace(
            {
                t.stem.removeprefix("step_trace-"): json.loads(t.read_text())
                for t in traces
            },
            root / "step_trace.png",
        )
    for f in sorted(root.glob("call*-perf*.jsonl")):
        rows = _jsonl(f)
        timed = [r for r in rows if "tok_s" in r]
        taus = sorted({r["tau"] for r in timed})
        for tau in taus:  # one plot per acceptance (PERF_TAU=3.5,6.35: one file)
            part = [r for r in timed if r["tau"] == tau]
            if not any(r["mode"] == "base" for r in part):
                continue
            name = f"{f.stem}-speedup.png"
            if len(taus) > 1:
                name = f"{f.stem}-tau{tau}-speedup.png"
            title = f"{part[0]['pair']} pair, acceptance {tau}, {f.stem}"
            plot_speedup(part, root / name, title)
    if (root / "acceptance.json").exists():
        plot_acceptance(
            json.loads((root / "acceptance.json").read_text()), root / "acceptance.png"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
