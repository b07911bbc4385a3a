# SPDX-License-Identifier: Apache-2.0
"""Patches that wrap the same vLLM symbol are chained in catalog order, whatever
order their trigger modules are imported in: the last in the catalog is the
outermost wrapper. An H200 run (2026-12-02) found ``dflash_trace`` (applied on import of
``vllm.v1.spec_decode.dflash``) inside ``dflash_context_only_pass`` (applied on
import of the model runner, which imports that module first), so the trace never
saw a context-only pass and its token history missed those steps' tokens (the
``-1`` entries of the H200 traces under asynchronous scheduling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib, json
    import vllm_dflash
    vllm_dflash.register()
    import vllm.v1.worker.gpu_model_runner  # what a worker imports first
    from vllm_dflash.catalog import PATCHES
    from vllm_dflash import registry
    for p in PATCHES:
        importlib.import_module(p.trigger_module)
    applied = [
        p for p in PATCHES
        if registry._results[p.name].state is registry.PatchState.APPLIED
    ]

    def resolve(target):
        mod, qual = target.split(":")
        *owners, attr = qual.split(".")
        obj = importlib.import_module(mod)
        for o in owners:
            obj = getattr(obj, o)
        if isinstance(obj, type):
            for klass in obj.__mro__:  # the class that defines it
                if attr in klass.__dict__:
                    return klass.__dict__[attr]
        return getattr(obj, attr, None)

    out = {}
    for target in sorted({t for p in applied for t in p.targets}):
        wrappers = [p.name for p in applied if target in p.targets]
        if len(wrappers) < 2:
            continue
        f, chain = resolve(target), []
        while f is not None:
            mark = getattr(f, "__vllm_dflash_patch__", None)
            if mark:
                chain.append(mark)
            f = getattr(f, "__wrapped_original__", None)
        out[target] = {"catalog": wrappers[::-1], "chain": chain}
    print("CHAINS", json.dumps(out))
    """
)


def test_same_symbol_patches_chain_in_catalog_order(tmp_path):
    env = {
        "VLLM_DFLASH_TRACE": str(tmp_path / "trace.jsonl"),  # env-gated patches on
        "VLLM_DFLASH_PROFILE": str(tmp_path / "profile.jsonl"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CHAINS "))
    chains = json.loads(line.split(" ", 1)[1])
    propose = "vllm.v1.spec_decode.dflash:DFlashProposer.propose"
    assert propose in chains, chains.keys()
    assert chains[propose]["chain"] == [
        "dflash_trace",
        "dflash_short_draft_block",
        "dflash_context_only_pass",
    ]
    wrong = {t: c for t, c in chains.items() if c["chain"] != c["catalog"]}
    assert not wrong, wrong
