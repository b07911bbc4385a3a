# SPDX-License-Identifier: Apache-2.0
"""``VLLM_DFLASH_PROFILE=out.json``: where the time of a DFlash step goes.

A measuring aid, installed only when the variable is set. It synchronises the
device at the edge of every section (so sections do not overlap and each time
is device work + host launch cost), which slows the run: compare its total
with an unprofiled run to see how much overlap the real step gets.

Sections per engine step (worker rank 0):
  target_forward     GPUModelRunner.execute_model (target forward, verify inputs)
  sample_verify      sample_tokens minus propose (sampling, rejection, bookkeeping)
  draft_inputs       proposer set_inputs_first_pass (input expansion)
  draft_metadata     attention metadata for the draft forward
  context_kv         drafter precompute_and_store_context_kv (fc'd context K/V)
  draft_fc           combine_hidden_states (fc over the target features)
  draft_sample       drafter logits + argmax
  draft_forward      the rest of propose: the drafter forward (+ glue)
It also counts the CUDA-graph dispatch decisions of the target and the drafter
(``mode:padded_tokens``), to tell a graph replay from an eager or piecewise step.
The file is rewritten after every step (mean milliseconds per section); a
reader that deletes it starts a new measurement window (totals reset).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import torch

from vllm_dflash import envs
from vllm_dflash.registry import (
    V020,
    Patch,
    PatchKind,
    PatchState,
    replace_attr,
)

NAME = "dflash_step_profile"
_WRAPPED = "_vllm_dflash_profiled"


class StepProfile:
    """Per-section totals; each mean is over the steps in which it ran (a step
    with a partial prefill chunk runs the target but drafts nothing)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.step: dict[str, float] = defaultdict(float)
        self.written = False
        self._reset()

    def _reset(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.dispatch: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.steps = 0
        self.reqs = 0

    def add(self, name: str, seconds: float) -> None:
        self.step[name] += seconds

    def add_dispatch(self, who: str, key: str) -> None:
        self.dispatch[who][key] += 1

    def end_step(self, num_reqs: int) -> None:
        step, self.step = self.step, defaultdict(float)
        draft_total = step.pop("draft_total", 0.0)
        if draft_total:
            parts = sum(
                v
                for k, v in step.items()
                if k.startswith("draft_") or k == "context_kv"
            )
            step["draft_forward"] = max(draft_total - parts, 0.0)
        step["sample_verify"] = max(step.pop("sample_total", 0.0) - draft_total, 0.0)
        if self.written and not os.path.exists(self.path):
            self._reset()  # the reader took the last window
        for k, v in step.items():
            self.totals[k] += v
            self.counts[k] += 1
        self.steps += 1
        self.reqs += num_reqs
        self.flush()

    def flush(self) -> None:
        ms = {
            k: round(1000 * v / self.counts[k], 4)
            for k, v in sorted(self.totals.items())
        }
        report = {
            "steps": self.steps,
            "draft_steps": self.counts.get("draft_forward", 0),
            "mean_batch": round(self.reqs / max(self.steps, 1), 2),
            "mean_ms": ms,
            "step_ms": round(sum(ms.values()), 4),
            "cudagraph_dispatch": {k: dict(v) for k, v in self.dispatch.items()},
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(tmp, self.path)
        self.written = True


def _timed(fn, prof: StepProfile, name: str):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        prof.add(name, time.perf_counter() - t0)
        return out

    return wrapper


def _counted(dispatch, prof: StepProfile, who: str):
    def wrapper(*args, **kwargs):
        mode, desc = dispatch(*args, **kwargs)
        prof.add_dispatch(who, f"{mode.name}:{desc.num_tokens}")
        return mode, desc

    return wrapper


def probe() -> bool:
    return envs.profile_path() is not None


def apply() -> None:
    from vllm.distributed import parallel_state
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prof = StepProfile(os.path.abspath(envs.profile_path()))
    # the current methods, not vLLM's originals: the patches applied before this
    # one (dflash_prefill_not_uniform_decode wraps execute_model) keep working
    # while profiling
    stock_execute = GPUModelRunner.execute_model
    stock_sample = GPUModelRunner.sample_tokens

    def rank0() -> bool:
        tp = parallel_state._TP
        return torch.cuda.is_available() and (tp is None or tp.rank_in_group == 0)

    def instrument(runner) -> None:
        if getattr(runner, _WRAPPED, False):
            return
        setattr(runner, _WRAPPED, True)
        disp = runner.cudagraph_dispatcher
        disp.dispatch = _counted(disp.dispatch, prof, "target")
        drafter = getattr(runner, "drafter", None)
        if drafter is None:
            return
        if hasattr(drafter, "cudagraph_dispatcher"):
            disp = drafter.cudagraph_dispatcher
            disp.dispatch = _counted(disp.dispatch, prof, "draft")
        for name, attr in (
            ("draft_inputs", "set_inputs_first_pass"),
            ("draft_metadata", "build_per_group_and_layer_attn_metadata"),
            ("draft_sample", "_greedy_sample"),
            ("draft_total", "propose"),
        ):
            setattr(drafter, attr, _timed(getattr(drafter, attr), prof, name))
        model = drafter.model
        for name, attr in (
            ("context_kv", "precompute_and_store_context_kv"),
            ("draft_fc", "combine_hidden_states"),
        ):
            if hasattr(model, attr):
                setattr(model, attr, _timed(getattr(model, attr), prof, name))

    def execute_model(self, *args, **kwargs):
        if not rank0():
            return stock_execute(self, *args, **kwargs)
        instrument(self)
        return _timed(stock_execute, prof, "target_forward")(self, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        if not rank0():
            return stock_sample(self, *args, **kwargs)
        out = _timed(stock_sample, prof, "sample_total")(self, *args, **kwargs)
        prof.end_step(self.input_batch.num_reqs)
        return out

    replace_attr(GPUModelRunner, "execute_model", execute_model, NAME)
    replace_attr(GPUModelRunner, "sample_tokens", sample_tokens, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
    ),
    summary="VLLM_DFLASH_PROFILE=file.json: mean time per section of a DFlash step (GPU).",
    why="Find where a DFlash step spends its time (target, context K/V, draft, sampling).",
    upstream="none, vllm-dflash feature",
    versions=V020,
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Keep (plugin feature).",
    when_probe_false=PatchState.NOT_APPLICABLE,
    probe_false_reason="VLLM_DFLASH_PROFILE is not set",
)
