# SPDX-License-Identifier: Apache-2.0
"""``vllm-dflash bench``: drive a running OpenAI-compatible server, report
throughput, TTFT, time per output token and DFlash acceptance (``/metrics`` deltas)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_dflash.entrypoints.cli.metrics import (
    acceptance_length,
    delta,
    fetch_spec_decode,
)


@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    output_tokens: int
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def load_prompts(path: Path) -> list[dict]:
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not ("prompt" in item or "messages" in item):
            raise ValueError(
                f"{path}:{n}: each line must be a JSON object with 'prompt' (completions) "
                "or 'messages' (chat), optionally 'max_tokens'"
            )
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def _one(
    client, model: str, item: dict, max_tokens: int, ignore_eos: bool
) -> RequestResult:
    start = time.perf_counter()
    first = None
    n_out = 0
    finish = None
    kwargs = dict(model=model, max_tokens=item.get("max_tokens", max_tokens), temperature=0,
                  stream=True, stream_options={"include_usage": True})  # fmt: skip
    if ignore_eos:
        kwargs["extra_body"] = {"ignore_eos": True}
    if "messages" in item:
        stream = client.chat.completions.create(messages=item["messages"], **kwargs)
    else:
        stream = client.completions.create(prompt=item["prompt"], **kwargs)
    for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        for choice in chunk.choices or ():
            finish = choice.finish_reason or finish
        if getattr(chunk, "usage", None):
            n_out = chunk.usage.completion_tokens
    end = time.perf_counter()
    return RequestResult(
        ttft_s=(first or end) - start,
        latency_s=end - start,
        output_tokens=n_out,
        finish_reason=finish,
    )


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_bench(base_url: str, model: str, prompts: list[dict], concurrency: int,
              max_tokens: int, ignore_eos: bool = False, progress: bool = True) -> dict:  # fmt: skip
    from openai import OpenAI
    from tqdm import tqdm

    client = OpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key="none", max_retries=0
    )
    before = fetch_spec_decode(base_url)
    bar = tqdm(total=len(prompts), desc="requests", disable=not progress)
    lock = threading.Lock()

    def work(item: dict) -> RequestResult:
        res = _one(client, model, item, max_tokens, ignore_eos)
        with lock:
            bar.update(1)
        return res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(work, prompts))
    wall = time.perf_counter() - t0
    bar.close()
    spec = delta(fetch_spec_decode(base_url), before)
    out_tokens = sum(r.output_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    tpots = [t for r in results if (t := r.tpot_s) is not None]
    drafts = spec.get("vllm:spec_decode_num_drafts", 0.0)
    return {
        "base_url": base_url,
        "model": model,
        "requests": len(results),
        "concurrency": concurrency,
        "duration_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "ttft_s": {
            "mean": statistics.fmean(ttfts),
            "p50": _pct(ttfts, 0.5),
            "p99": _pct(ttfts, 0.99),
        },
        "tpot_s": {
            "mean": statistics.fmean(tpots) if tpots else None,
            "p50": _pct(tpots, 0.5),
            "p99": _pct(tpots, 0.99),
        },
        "spec_decode": {
            "drafts": drafts,
            "draft_tokens": spec.get("vllm:spec_decode_num_draft_tokens", 0.0),
            "accepted_tokens": spec.get("vllm:spec_decode_num_accepted_tokens", 0.0),
            "acceptance_length": acceptance_length(spec),
            "counters": spec,
        },
        "per_request": [asdict(r) for r in results],
    }


def format_summary(r: dict) -> str:
    s = r["spec_decode"]
    tau = s["acceptance_length"]
    tpot = r["tpot_s"]["mean"]
    return "\n".join(
        [
            f"requests {r['requests']} at concurrency {r['concurrency']} in {r['duration_s']:.2f} s",
            f"output throughput  {r['output_tokens_per_s']:.1f} tok/s ({r['output_tokens']} tokens)",
            f"TTFT mean/p50/p99  {r['ttft_s']['mean'] * 1e3:.1f} / {r['ttft_s']['p50'] * 1e3:.1f} / {r['ttft_s']['p99'] * 1e3:.1f} ms",
            f"TPOT mean          {tpot * 1e3:.2f} ms"
            if tpot is not None
            else "TPOT mean          n/a",
            f"acceptance length  {tau:.2f} tokens/step ({s['accepted_tokens']:.0f} accepted / "
            f"{s['drafts']:.0f} drafts)"
            if tau is not None
            else "acceptance length  n/a (no drafts: is speculative decoding on?)",
        ]
    )
