# SPDX-License-Identifier: Apache-2.0
"""Acceptance length and throughput of a DFlash drafter through ``vllm serve``.

Used by the CPU acceptance tests (tests/e2e/test_acceptance.py) and the
benchmark (benchmarks/cpu_acceptance.py): one server per configuration, the
same greedy requests (token-id prompts, ``ignore_eos``), counters from
/metrics before and after.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dflash.testing.metrics import acceptance_length, delta
from vllm_dflash.testing.server import VllmServer, speculative_config_arg

SERVE_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    "--max-num-seqs", "8", "--block-size", "16",
]  # fmt: skip


@dataclass
class AcceptanceRun:
    name: str
    outputs: list[str]
    acceptance_length: float | None
    drafts: float
    output_tokens: int
    seconds: float
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return {
            "acceptance_length": self.acceptance_length,
            "drafts": self.drafts,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "output_tokens_per_s": round(self.tokens_per_s, 2),
        }


def serve_and_measure(
    name: str,
    target: Path,
    prompts: list[list[int]],
    drafter: Path | None = None,
    k: int = 7,
    max_tokens: int = 64,
    concurrency: int = 4,
    disable: tuple[str, ...] = (),
    log_dir: Path | None = None,
) -> AcceptanceRun:
    """Start a server, send every prompt (``concurrency`` at a time), stop it."""
    from openai import OpenAI

    extra = list(SERVE_ARGS)
    if drafter is not None:
        extra += speculative_config_arg(str(drafter), k)
    env = {"VLLM_DFLASH_DISABLE": ",".join(disable)}
    log = (log_dir / f"serve-{name}.log") if log_dir else None
    with VllmServer(str(target), extra, env=env, log_path=log) as srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")

        def complete(p: list[int]) -> tuple[str, int]:
            r = client.completions.create(
                model=str(target), prompt=p, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.choices[0].text, r.usage.completion_tokens

        complete(prompts[0][:4])  # warm-up, excluded from the counters
        before = srv.metrics()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(complete, prompts))
        seconds = time.perf_counter() - t0
        counters = delta(srv.metrics(), before)
    return AcceptanceRun(
        name=name,
        outputs=[text for text, _ in results],
        acceptance_length=acceptance_length(counters),
        drafts=counters.get("vllm:spec_decode_num_drafts", 0.0),
        output_tokens=sum(n for _, n in results),
        seconds=seconds,
        counters=counters,
    )
