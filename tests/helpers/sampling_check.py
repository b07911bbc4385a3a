# SPDX-License-Identifier: Apache-2.0
"""The statistical distribution check shared by the CPU test (tests/e2e/test_sampling.py)
and the GPU script (benchmarks/gpu/sampling_check.py).

One DFlash engine and one no-speculation engine each generate every request group
below in ONE ``LLM.generate`` call (so greedy and random requests, seeded and
unseeded, share batches). Every sampled group repeats one prompt ``n`` times; the
empirical distribution of its output token at each of the first ``N_TOKENS``
positions is compared (chi-square, tests/helpers/stats.py) with the exact float64
marginal from the target (tests/helpers/marginals.py). Token 1 is sampled at prefill;
tokens 2.. go through DFlash's verification (acceptance of greedy drafts, recovery
from the residual, bonus tokens).

Cases: temperature 0.6 and 1.0, top-p, top-k, penalties (vLLM applies them in the
verify path too), per-request seeds (distribution over seeds, and the same seeds
give the same outputs in two more runs), greedy rows in the same batches (DFlash
output == no-spec output). min-p: vLLM 0.20-0.23 refuse ``min_p`` (and
``logit_bias``) with every speculative method ("not yet supported with speculative
decoding"); each engine is asked for one min-p request and the check asserts the
refusal with DFlash and the acceptance without speculation.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.engine_log import run_engine_process
from tests.helpers.marginals import Params, Target
from tests.helpers.stats import ALPHA, fit

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "helpers" / "sampling_run.py"
N_TOKENS = 3
REPEAT_N = 48  # seeded requests generated again, twice


@dataclass(frozen=True)
class Group:
    name: str
    params: Params
    n: int
    seed_base: int | None = None


def groups(n: int) -> list[Group]:
    return [
        Group("t0.6", Params(temperature=0.6), n),
        Group("t1.0", Params(temperature=1.0), n),
        Group("top_p", Params(temperature=1.0, top_p=0.7), n),
        Group("top_k", Params(temperature=1.0, top_k=6), n),
        Group(
            "penalties",
            Params(
                temperature=1.0,
                repetition_penalty=1.5,
                frequency_penalty=0.8,
                presence_penalty=0.5,
            ),
            n,
        ),
        Group("seeded", Params(temperature=1.0), n, seed_base=1000),
    ]


def greedy_prompts(n: int = 24) -> list[list[int]]:
    return [
        [4 + (i * 37 + j * 11) % 500 for j in range(6 + (i * 7) % 30)] for i in range(n)
    ]


def groups_json(prompt: list[int], gs: list[Group], greedy_tokens: int) -> list[dict]:
    out = []
    for g in gs:
        params = {**g.params.vllm_kwargs(), "max_tokens": N_TOKENS}
        out.append(
            {"name": g.name, "n": g.n, "prompt": prompt, "params": params,
             "seed_base": g.seed_base, "repeat": False}
        )  # fmt: skip
        if g.seed_base is not None:
            out.append(
                {"name": g.name + "-repeat", "n": REPEAT_N, "prompt": prompt,
                 "params": params, "seed_base": g.seed_base, "repeat": True}
            )  # fmt: skip
    gp = greedy_prompts()
    out.append(
        {"name": "greedy", "n": len(gp), "prompts": gp,
         "params": {"temperature": 0.0, "max_tokens": greedy_tokens}}
    )  # fmt: skip
    return out


def run_engine(
    target: Path,
    drafter: Path | None,
    groups_file: Path,
    out: Path,
    extra_args: list[str] = (),
    env: dict | None = None,
    timeout: float = 900,
) -> tuple[int, dict | None, str]:
    cmd = [sys.executable, str(RUNNER), "--target", str(target), "--groups",
           str(groups_file), "--out", str(out), *extra_args]  # fmt: skip
    if drafter is not None:
        cmd += ["--drafter", str(drafter)]
    e = {**os.environ, **(env or {})}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    rc, log = run_engine_process(cmd, e, timeout)  # one rerun for a machine fault
    data = json.loads(out.read_text()) if rc == 0 and out.exists() else None
    return rc, data, log


def exact(target: Target, prompt: list[int], gs: list[Group]) -> dict:
    """{group: Marginals}: the exact marginals of each group."""
    return {g.name: target.marginals(prompt, g.params, N_TOKENS) for g in gs}


def evaluate(
    gs: list[Group],
    marg: dict,
    runs: dict[str, dict],
    alpha: float = ALPHA,
    min_accept: float = 0.02,
    seeds_across_batches: bool = False,
    unseeded: tuple[str, ...] = (),
) -> list[dict]:
    """One check per (engine, group, position) + greedy, seeds, acceptance.

    Engines named ``no-spec`` run without speculation; every other engine is a
    speculative one (greedy rows compared with ``no-spec``'s, acceptance checked).
    Engines in ``unseeded`` get no seed-reproducibility checks: with an adaptive
    draft length a seeded request's random draws follow the number of drafts
    each step verifies, which depends on the batch (its distribution is still
    checked).

    ``seeds_across_batches``: also require that seeds ``seed_base ..
    seed_base + REPEAT_N - 1`` gave the same outputs in the mixed, possibly
    chunked main batch (twice: the group and its ``-repeat`` group) as in the
    repeat runs, where they are generated alone (CUDA's semantics: a seeded
    request's draws come from its own generator, and a discarded partial-prefill
    sample is rewound). Exact only while the target's logits do not depend on the
    batch (float32 on CPU); the GPU script leaves it off.
    """
    checks = []
    for engine, data in runs.items():
        spec = engine != "no-spec"
        for g in gs:
            outs = data["groups"][g.name]
            m = marg[g.name]
            for t in range(N_TOKENS):
                r = fit([o[t] for o in outs], m.probs[t], pruned_mass=m.pruned[t])
                checks.append({
                    "check": "distribution", "engine": engine, "group": g.name,
                    "token": t + 1, "ok": r.ok(alpha), "n": r.n, "chi2": round(r.chi2, 2),
                    "df": r.df, "p_value": r.p_value, "tv": round(r.tv, 4),
                    "pruned_mass": m.pruned[t],
                })  # fmt: skip
            if g.seed_base is not None and engine not in unseeded:
                a, b = data["repeats"][g.name + "-repeat"]
                checks.append({
                    "check": "seeded_repeat", "engine": engine, "group": g.name,
                    "ok": a == b, "n": len(a), "equal": sum(x == y for x, y in zip(a, b, strict=False)),
                })  # fmt: skip
                if seeds_across_batches:
                    main = outs[: len(a)] + data["groups"][g.name + "-repeat"]
                    alone = a + a
                    same = sum(x == y for x, y in zip(main, alone, strict=True))
                    checks.append({
                        "check": "seeded_main_batch_equals_alone", "engine": engine,
                        "group": g.name, "ok": same == len(alone), "n": len(alone),
                        "equal": same,
                    })  # fmt: skip
        refused = str(data.get("min_p_request", "")).startswith("refused")
        checks.append({
            "check": "min_p_refused_with_speculation", "engine": engine, "group": "min_p",
            "ok": refused == spec, "detail": data.get("min_p_request"),
        })  # fmt: skip
    for engine in runs:
        if engine == "no-spec" or "no-spec" not in runs:
            continue
        a, b = runs[engine]["groups"]["greedy"], runs["no-spec"]["groups"]["greedy"]
        checks.append({
            "check": "greedy_lossless", "engine": engine, "group": "greedy", "ok": a == b,
            "n": len(a), "equal": sum(x == y for x, y in zip(a, b, strict=False)),
        })  # fmt: skip
        sd = runs[engine].get("spec_decode", {})
        drafted = sd.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = sd.get("vllm:spec_decode_num_accepted_tokens", 0)
        rate = accepted / drafted if drafted else 0.0
        checks.append({
            "check": "acceptance_and_rejection", "engine": engine, "group": "all",
            "ok": drafted > 0 and min_accept <= rate < 0.98, "drafted": drafted,
            "accepted": accepted, "rate": round(rate, 4),
        })  # fmt: skip
    return checks


def summary(checks: list[dict]) -> str:
    bad = [c for c in checks if not c["ok"]]
    lines = [f"{len(checks) - len(bad)}/{len(checks)} checks pass"]
    for c in bad:
        lines.append("FAIL " + json.dumps(c))
    return "\n".join(lines)


LOGIT_SCALE = 14.0


def sampling_pair(root: Path, prompt: list[int]) -> tuple[Path, Path, int]:
    """(target, drafter, X): a peaked tiny target and a drafter that always drafts X.

    Target: the trained tiny target's architecture and weights
    (vllm_dflash/testing/trained.py, ``TRAINED_TARGET``) with its lm_head scaled
    x14: its next-token distributions are nearly uniform otherwise (entropy ~6.1 of
    ln 512 = 6.24 nats at temperature 1), so no draft would ever be accepted; scaled,
    the first 3 tokens have entropy ~1.8-3.1 nats and top tokens of 0.3-0.4.

    Drafter: a 2-layer DFlash drafter whose o_proj/down_proj are zero, so the hidden
    state at every mask position is the target's embedding of the mask token; its
    final norm weight maps that onto lm_head row X. It drafts X at every position,
    whatever the context. X is the token with the largest probability summed over
    the exact marginals of output tokens 2 and 3 at temperature 1: drafts are
    accepted (probability p(X), ~0.2-0.4) and rejected, which is what a sampling test
    needs. Built in seconds (no training); deterministic.
    """
    from safetensors.torch import save_file

    from tests.helpers.marginals import Params, Target
    from vllm_dflash.testing.tiny_models import (
        DrafterSpec,
        build_drafter,
        build_target,
        drafter_state_dict,
    )
    from vllm_dflash.testing.trained import TRAINED_TARGET

    target, drafter = root / "target-x14", root / "drafter-oracle"
    done = root / ".complete"
    if done.exists():
        return target, drafter, int(done.read_text())
    import torch
    from safetensors.torch import load_file

    build_target(target, TRAINED_TARGET)
    state = load_file(str(target / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * LOGIT_SCALE
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    m = Target(target).marginals(prompt, Params(temperature=1.0), 3)
    x = int((m.probs[1] + m.probs[2]).argmax())
    spec = DrafterSpec(
        name="drafter-oracle",
        layer_types=("full_attention", "full_attention"),
        target_layer_ids=(0, 1),
        block_size=8,
    )
    ds = drafter_state_dict(spec, TRAINED_TARGET)
    for k in ds:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            ds[k].zero_()
    e = state["model.embed_tokens.weight"][3].to(torch.float64)  # MASK_ID
    e_hat = e * torch.rsqrt(e.pow(2).mean() + 1e-6)
    w = state["lm_head.weight"].to(torch.float64)
    ds["norm.weight"] = (w[x] / e_hat).to(torch.float32)
    logits = w @ (ds["norm.weight"].to(torch.float64) * e_hat)
    assert int(logits.argmax()) == x, "oracle drafter would not draft X"
    build_drafter(drafter, spec, TRAINED_TARGET, state=ds)
    done.write_text(str(x))
    return target, drafter, x


def sampling_prompt() -> list[int]:
    """The prompt of every sampled group (12 tokens; first 3 output tokens of the
    x14 target at temperature 1 have entropy ~1.8-3.1 nats)."""
    from vllm_dflash.training.data import synthetic_prompts

    return synthetic_prompts(16, (5, 40), (4, 512), seed=12345)[0][:12]


# X's temperature-1 marginal at output token 2 that the lm_head scale aims at (the
# dense pair's X: ~0.27): the first draft is accepted about that often.
HYBRID_X_MASS = 0.25


def hybrid_prompt() -> list[int]:
    """12 tokens below the tiny hybrid's vision special tokens (504..507)."""
    from vllm_dflash.training.data import synthetic_prompts

    return synthetic_prompts(16, (5, 40), (4, 504), seed=12345)[0][:12]


def _scale_for_x_mass(
    target, prompt: list[int], mass: float
) -> tuple[float, int, float]:
    """(s, X, m): the lm_head scale s at which the largest temperature-1 marginal of
    output token 2 is ``mass`` (bisection over s; the marginals at scale s are the
    unscaled model's at temperature 1/s, and the forwards are memoised, so each
    step after the first costs little). X: that token; m: its marginal."""
    from tests.helpers.marginals import Params

    lo, hi = 0.5, 8.0
    for _ in range(24):
        mid = (lo + hi) / 2
        m = target.marginals(prompt, Params(temperature=1.0 / mid), 2).probs[1]
        lo, hi = (mid, hi) if float(m.max()) < mass else (lo, mid)
    s = (lo + hi) / 2
    m = target.marginals(prompt, Params(temperature=1.0 / s), 2).probs[1]
    return s, int(m.argmax()), float(m.max())


def hybrid_sampling_pair(
    root: Path, prompt: list[int], spec=None, drafter_spec=None
) -> tuple[Path, Path, int]:
    """(target, drafter, X) for a Qwen3.5-architecture hybrid
    (vllm_dflash/testing/tiny_hybrid.py: GDN + gated attention, M-RoPE, vision tower;
    ``spec``/``drafter_spec`` default to the CPU fixture ``HYBRID``/``HYBRID_DRAFTER``,
    the GPU stage passes ``GPU_HYBRID``/``GPU_HYBRID_DRAFTER``: head sizes 128).

    Target: the hybrid with its lm_head scaled so that the most likely output token 2
    (temperature 1, marginal over token 1) has probability ``HYBRID_X_MASS``
    (unscaled, the CPU fixture's first token has entropy 4.9 nats and no draft would
    be accepted).
    Drafter: the drafter spec's architecture (layers [sliding, sliding, full],
    window 6, block 8, target layer ids (1, 3, 6): GDN, attention, GDN) made an
    oracle like ``sampling_pair``'s: o_proj/down_proj zero, final norm mapping the
    mask token's embedding onto lm_head row X, the token with the largest
    temperature-1 marginal at output token 2. Every layer still runs (sliding and
    full attention metadata, context K/V from the target's GDN and attention
    features); only its output is fixed. ``root/pair.json`` records the scale and
    X's marginal.
    """
    from safetensors.torch import load_file, save_file

    from tests.helpers.marginals import HybridTarget
    from vllm_dflash.testing.tiny_hybrid import (
        HYBRID,
        HYBRID_DRAFTER,
        build_hybrid_target,
        text_spec,
    )
    from vllm_dflash.testing.tiny_models import build_drafter, drafter_state_dict

    spec = spec or HYBRID
    drafter_spec = drafter_spec or HYBRID_DRAFTER
    target, drafter = root / "hybrid-target", root / "hybrid-drafter-oracle"
    done = root / ".complete"
    if done.exists():
        return target, drafter, int(done.read_text())
    import torch

    build_hybrid_target(target, spec)
    # Output token 2's marginal only (two levels: ~10x cheaper than three).
    scale, x, x_mass = _scale_for_x_mass(HybridTarget(target), prompt, HYBRID_X_MASS)
    state = load_file(str(target / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * scale
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    ds = drafter_state_dict(drafter_spec, text_spec(spec))
    for k in ds:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            ds[k].zero_()
    e = state["model.language_model.embed_tokens.weight"][3].to(torch.float64)  # MASK
    e_hat = e * torch.rsqrt(e.pow(2).mean() + 1e-6)
    w = state["lm_head.weight"].to(torch.float64)
    ds["norm.weight"] = (w[x] / e_hat).to(torch.float32)
    logits = w @ (ds["norm.weight"].to(torch.float64) * e_hat)
    assert int(logits.argmax()) == x, "oracle drafter would not draft X"
    build_drafter(drafter, drafter_spec, text_spec(spec), state=ds)
    (root / "pair.json").write_text(
        json.dumps({"lm_head_scale": scale, "x": x, "x_marginal_token2": x_mass})
    )
    done.write_text(str(x))
    return target, drafter, x
