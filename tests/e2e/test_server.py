# SPDX-License-Identifier: Apache-2.0
"""``vllm serve --speculative-config`` with DFlash on CPU, through the OpenAI client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_dflash.testing.server import VllmServer, acceptance_length, speculative_config_arg

pytestmark = pytest.mark.cpu_e2e

COMMON = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "8"]


def _prompts() -> list[str]:
    return [
        " ".join(f"<t{4 + (i * 31 + j * 17) % 500}>" for j in range(3 + (i * 7) % 30))
        for i in range(8)
    ]


def _serve_and_query(model: str, extra: list[str], tmp_path, tag: str) -> dict:
    from openai import OpenAI

    srv = VllmServer(model, COMMON + extra, log_path=tmp_path / f"{tag}.log")
    with srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")

        def complete(p: str) -> str:
            r = client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            completions = list(pool.map(complete, _prompts()))
        chats = [
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": p}],
                max_tokens=16,
                temperature=0,
            )
            .choices[0]
            .message.content
            for p in _prompts()[:2]
        ]
        metrics = srv.metrics()
    rc = srv.proc.returncode
    log = srv.log_path.read_text(errors="replace")
    return {"completions": completions, "chats": chats, "metrics": metrics, "rc": rc, "log": log}


def test_serve_dflash_is_lossless(tiny_models, tmp_path):
    model = str(tiny_models.target)
    base = _serve_and_query(model, [], tmp_path, "base")
    spec = _serve_and_query(
        model, speculative_config_arg(str(tiny_models.swa), 4), tmp_path, "dflash"
    )
    assert all(base["completions"]) and all(base["chats"])
    assert spec["completions"] == base["completions"]
    assert spec["chats"] == base["chats"]
    assert spec["metrics"].get("vllm:spec_decode_num_drafts", 0) > 0, spec["metrics"]
    assert acceptance_length(spec["metrics"]) is not None
    for r in (base, spec):
        assert r["rc"] == 0, r["log"][-3000:]  # stopped cleanly on SIGINT
        assert "Traceback" not in r["log"], r["log"][-3000:]
