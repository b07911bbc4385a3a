# SPDX-License-Identifier: Apache-2.0
"""``vllm serve --speculative-config`` with DFlash on CPU, through the OpenAI client."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_dflash.testing.server import VllmServer, acceptance_length

pytestmark = pytest.mark.cpu_e2e

COMMON = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--enforce-eager",
    "--max-num-seqs",
    "8",
]


def _prompts() -> list[str]:
    return [
        " ".join(f"<t{4 + (i * 31 + j * 17) % 500}>" for j in range(3 + (i * 7) % 30))
        for i in range(8)
    ]


def _bench(base_url: str, model: str, tmp_path) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in _prompts())
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": _prompts()[0]}]})
        + "\n"
    )
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "vllm_dflash.entrypoints.cli.main", "bench", "--base-url", base_url,
        "--model", model, "--prompts", str(prompts), "--concurrency", "4",
        "--max-tokens", "16", "--num-prompts", "12", "--ignore-eos", "--out", str(out),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "acceptance length" in res.stdout
    return json.loads(out.read_text())


def _unexpected_tracebacks(log: str) -> list[str]:
    """Tracebacks in a server log, minus the known shutdown noise after Ctrl-C
    (SIGINT to the process group): the worker's SystemExit from vLLM's signal
    handler and, with PyPI's CUDA torch on CPU, its search for an NVIDIA driver."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    noise = ("SystemExit", "Found no NVIDIA driver")
    return [b[:3000] for b in blocks if not any(n in b for n in noise)]


def _serve_and_query(
    model: str, extra: list[str], tmp_path, tag: str, bench: bool = False
) -> dict:
    from openai import OpenAI

    srv = VllmServer(model, COMMON + extra, log_path=tmp_path / f"{tag}.log")
    with srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")

        def complete(p: str) -> str:
            r = client.completions.create(
                model=model, prompt=p, max_tokens=24, temperature=0
            )
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            completions = list(pool.map(complete, _prompts()))
        chats = [
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": p}],
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
            for p in _prompts()[:2]
        ]
        metrics = srv.metrics()
        bench_result = _bench(srv.base_url, model, tmp_path) if bench else None
    rc = srv.proc.returncode
    log = srv.log_path.read_text(errors="replace")
    return {
        "completions": completions,
        "chats": chats,
        "metrics": metrics,
        "bench": bench_result,
        "rc": rc,
        "log": log,
    }


def test_serve_dflash_is_lossless(tiny_models, tmp_path):
    model = str(tiny_models.target)
    base = _serve_and_query(model, [], tmp_path, "base")
    # Exactly what arrives when a shell or ssh strips the JSON quotes.
    stripped = f"{{method:dflash,model:{tiny_models.swa},num_speculative_tokens:4}}"
    spec = _serve_and_query(
        model, ["--speculative-config", stripped], tmp_path, "dflash", bench=True
    )
    # Random tiny weights: some outputs may decode to special tokens only.
    assert sum(bool(c) for c in base["completions"] + base["chats"]) >= 6
    assert spec["completions"] == base["completions"]
    assert spec["chats"] == base["chats"]
    assert spec["metrics"].get("vllm:spec_decode_num_drafts", 0) > 0, spec["metrics"]
    assert acceptance_length(spec["metrics"]) is not None
    b = spec["bench"]
    assert (
        b["requests"] == 12 and b["output_tokens"] >= 11 * 16
    )  # one prompt stops (also without DFlash)
    assert b["output_tokens_per_s"] > 0 and b["ttft_s"]["p50"] > 0
    assert b["spec_decode"]["drafts"] > 0  # /metrics delta over the bench only
    assert b["spec_decode"]["acceptance_length"] >= 1.0
    for r in (base, spec):
        assert r["rc"] == 0, r["log"][-3000:]  # stopped cleanly on SIGINT
        assert not _unexpected_tracebacks(r["log"]), _unexpected_tracebacks(r["log"])[0]
