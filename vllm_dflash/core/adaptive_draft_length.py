# SPDX-License-Identifier: Apache-2.0
"""``"draft_length": "adaptive"``: the scheduler verifies as many drafts as pay off.

Two patches, one per process that needs them:

* ``dflash_draft_length_config`` (front end, ``EngineArgs.create_engine_config``):
  takes the ``draft_length`` key out of the speculative config before vLLM parses
  it and keeps it in ``VllmConfig.additional_config`` (``config/draft_length.py``).
* ``dflash_adaptive_draft_length`` (engine core, ``Scheduler.__init__``): a DFlash
  scheduler in adaptive mode gets a :class:`DraftLengthController` bound to its
  ``schedule`` and ``update_from_output`` (instance attributes: no other scheduler,
  and no engine without the key, runs any of this). Per step it

  1. asks :class:`DraftLengthPolicy` for a draft length ``d`` for the running
     batch, capped by what the drafter produced (``0`` after a context-only pass);
  2. trims each running request's draft list to ``d`` before vLLM's own
     ``schedule`` (vLLM already verifies fewer drafts when the token budget is
     short, so the runner, the rejection sampler and asynchronous scheduling's
     placeholders handle shorter lists);
  3. keeps each decoding request left with 0 drafts (``d == 0``, or the token
     budget) in ``scheduled_spec_decode_tokens`` with an empty list: the runner then
     treats it as a speculative decode of one token, so hybrid targets read their
     Gated-DeltaNet state from the slot of the last accepted token (a plain decode
     reads slot 0: wrong after accepted drafts; for a batch of such decodes only,
     see ``spec_decode/gdn_zero_drafts.py``);
  4. tells the worker on the scheduler output (attribute ``vllm_dflash_drafts_next``)
     how many drafts the next step verifies at most (the policy's length for
     this batch): at 0 the drafter runs a context-only pass
     (``spec_decode/context_only_pass.py``), below ``k`` a block of that many
     masks (``spec_decode/short_draft_block.py``; or the full block with its
     draft head over those positions only, ``spec_decode/partial_draft_head.py``);
     the next step is capped at that number;
  5. when the step's output arrives, feeds the policy the wall time since the
     previous output (decode-only steps whose length and bucket equal the step
     before: no prefill, no transition) and the accepted count per request.

Greedy output is unchanged (verification of fewer drafts is still exact). Before
a step that verifies ``0 < d < k`` drafts the drafter runs a block of ``d`` masks
(``spec_decode/short_draft_block.py``): its drafts equal the reference's for that
block (with that patch disabled, the full block's first ``d``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_dflash import envs
from vllm_dflash.config import draft_length as draft_length_config
from vllm_dflash.core.draft_length_policy import DraftLengthPolicy, bucket_of
from vllm_dflash.core.step_clock import StepClock
from vllm_dflash.logger import init_logger
from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    is_patched,
    raise_if_failed,
    replace_attr,
)

logger = init_logger(__name__)

CONFIG_NAME = "dflash_draft_length_config"
NAME = "dflash_adaptive_draft_length"
# On SchedulerOutput: the number of drafts (0..k) the step after this one
# verifies at most. Absent: k (no adaptive draft length).
DRAFTS_NEXT_ATTR = "vllm_dflash_drafts_next"
_CONTROLLER = "_vllm_dflash_draft_length"


@dataclass
class _Step:
    d: int
    num_reqs: int
    measurable: bool  # decode-only, same length and bucket as the step before


class DraftLengthController:
    """Per-step draft length for one scheduler (see the module docstring)."""

    def __init__(
        self,
        scheduler: Any,
        k: int,
        forced: tuple[int, ...] | None = None,
        policy: DraftLengthPolicy | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.k = k
        self.policy = policy or DraftLengthPolicy(k)
        self.forced = tuple(min(d, k) for d in forced) if forced else None
        self._forced_i = 0
        # request -> drafts its newest drafter pass computed (the drafter pass of
        # the last step that scheduled it; 0 after a context-only pass). A request
        # that sat out a step still holds that pass's drafts: zeros after them.
        self._drafted: dict[str, int] = {}
        self._clock: StepClock[_Step] = StepClock()
        self._prev_key: tuple[int, int] | None = None
        self._last_log = 0.0
        self._logged: dict[int, int] = {}
        self.steps_by_length: dict[int, int] = {}  # d -> scheduled steps (tests, logs)
        # scheduled requests of steps after which the drafter drafts / only stores
        # its context / drafts fewer than k positions (tests)
        self.rows_by_pass = {"query": 0, "context": 0, "partial": 0}

    def _want(self, num_reqs: int) -> int:
        if self.forced is not None:
            d = self.forced[self._forced_i % len(self.forced)]
            self._forced_i += 1
            return d
        return self.policy.choose(num_reqs)

    def _drafts_next(self, d_want: int) -> int:
        """What the drafter drafts for the next step: the length the policy wants
        for this batch now (a step later it may want more, e.g. to probe a longer
        length: that step is capped here, the one after it gets its length)."""
        if self.forced is not None:
            return self.forced[self._forced_i % len(self.forced)]
        return d_want

    def schedule(self, stock_schedule) -> Any:
        running = self.scheduler.running
        num_reqs = len(running)
        d_want = self._want(num_reqs)
        drafted = self._drafted
        # each request with drafts, and how many its drafter pass computed
        caps = {
            r.request_id: drafted.get(r.request_id, self.k)
            for r in running
            if r.spec_token_ids
        }
        d = min(d_want, max(caps.values(), default=d_want))
        for req in running:
            cap = caps.get(req.request_id)
            if cap is not None and len(req.spec_token_ids) > min(d, cap):
                req.spec_token_ids = req.spec_token_ids[: min(d, cap)]
        scheduled_at = time.perf_counter()
        out = stock_schedule()
        spec = out.scheduled_spec_decode_tokens
        # A decode left with 0 drafts (by d == 0, or by the token budget) stays
        # speculative: an empty list, not absent (module docstring, step 3).
        scheduled = out.num_scheduled_tokens
        for req_id in caps:
            if req_id not in spec and scheduled.get(req_id) == 1:
                spec[req_id] = []
        drafts_next = self._drafts_next(d_want)
        setattr(out, DRAFTS_NEXT_ATTR, drafts_next)
        n_sched = len(out.num_scheduled_tokens)
        # the drafter pass after this step drafts for exactly the scheduled requests
        for req_id in scheduled:
            drafted[req_id] = drafts_next
        if len(drafted) > 2 * num_reqs + 64:  # finished requests
            live = {r.request_id for r in running}
            self._drafted = {r: n for r, n in drafted.items() if r in live}
        decode_only = (
            n_sched > 0
            and not out.scheduled_new_reqs
            and out.total_num_scheduled_tokens == n_sched * (1 + d)
        )
        key = (d, bucket_of(n_sched))
        measurable = decode_only and key == self._prev_key
        self._prev_key = key if decode_only else None
        if n_sched:
            self._clock.scheduled(out, _Step(d, n_sched, measurable), scheduled_at)
            self.steps_by_length[d] = self.steps_by_length.get(d, 0) + 1
            self.rows_by_pass["query" if drafts_next else "context"] += n_sched
            if 0 < drafts_next < self.k:
                self.rows_by_pass["partial"] += n_sched
        return out

    def observe(self, scheduler_output: Any, model_runner_output: Any) -> None:
        timed = self._clock.output(scheduler_output)
        if timed is None:
            return
        step = timed.payload
        if step.measurable and timed.after_output:
            self.policy.observe_step(step.num_reqs, step.d, timed.seconds)
        spec = scheduler_output.scheduled_spec_decode_tokens
        sampled = getattr(model_runner_output, "sampled_token_ids", None)
        index = getattr(model_runner_output, "req_id_to_index", None)
        if step.d and spec and sampled and index:
            drafts, accepted = [], []
            for req_id, ids in spec.items():
                i = index.get(req_id)
                if ids and i is not None and sampled[i]:
                    drafts.append(len(ids))
                    accepted.append(len(sampled[i]) - 1)
            if drafts:
                self.policy.observe_acceptance(np.array(drafts), np.array(accepted))
        self._maybe_log(time.perf_counter())

    def _maybe_log(self, now: float) -> None:
        if self.forced is not None or now - self._last_log < 10.0:
            return
        chosen = {
            b: self.policy.candidates[bk.current]
            for b, bk in self.policy.buckets.items()
            if bk.current >= 0
        }
        if chosen != self._logged:
            self._last_log, self._logged = now, chosen
            buckets = self.policy.describe()["buckets"]
            ranges = {
                f"{1 << (b - 1)}-{(1 << b) - 1}": (d, buckets[b]["ms"])
                for b, d in sorted(chosen.items())
            }
            logger.info(
                "DFlash adaptive draft length (requests: drafts verified, measured "
                "step ms per length) %s; acceptance per position %s",
                ranges,
                [round(float(p), 2) for p in self.policy.conditional_rates()],
            )


def full_graph_tokens(vllm_config: Any) -> int:
    """Largest batch (tokens) of ``1 + k``-token decodes that vLLM runs as the
    target's full CUDA graph (``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``: full
    graphs for uniform decode batches up to ``max_cudagraph_capture_size``); 0
    when it has none (eager, piecewise only, CPU). The scheduler sees the mode as
    configured; a worker that lowers it (a backend without full graphs) makes
    the policy keep k's measured time apart from the fit, nothing else."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if (
        mode is None
        or mode.decode_mode() != CUDAGraphMode.FULL
        or not mode.separate_routine()
    ):
        return 0
    return int(compilation.max_cudagraph_capture_size or 0)


def controller_of(scheduler: Any) -> DraftLengthController | None:
    return getattr(scheduler, _CONTROLLER, None)


# -- dflash_draft_length_config (front end) ---------------------------------
def config_probe() -> bool:
    from vllm.config.speculative import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    return draft_length_config.KEY not in fields


def config_apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    current = EngineArgs.create_engine_config
    if is_patched(current, CONFIG_NAME):
        return

    def create_engine_config(self, *args, **kwargs):
        given = self.speculative_config
        rest, mode = draft_length_config.split(given)
        if mode is None:
            return current(self, *args, **kwargs)
        self.speculative_config = rest
        try:
            config = current(self, *args, **kwargs)
        finally:
            self.speculative_config = given
        draft_length_config.store(config, mode)
        return config

    replace_attr(EngineArgs, "create_engine_config", create_engine_config, CONFIG_NAME)


# -- dflash_adaptive_draft_length (engine core) -------------------------------
def scheduler_probe() -> bool:
    return True  # no vLLM release (0.20-0.23) varies the V1 draft length per step


def scheduler_apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    stock_init = Scheduler.__init__
    if is_patched(stock_init, NAME):
        return

    def __init__(self, *args, **kwargs) -> None:
        stock_init(self, *args, **kwargs)
        vllm_config = self.vllm_config
        spec = vllm_config.speculative_config
        if spec is not None and spec.method == "dflash":
            # A DFlash engine's scheduler: refuse a patch that failed in this
            # process, and log the applied ones at INFO from here on.
            raise_if_failed()
        if (
            draft_length_config.mode_of(vllm_config) != draft_length_config.ADAPTIVE
            or not self.num_spec_tokens
        ):
            return
        k = self.num_spec_tokens
        ctl = DraftLengthController(
            self,
            k,
            forced=envs.draft_length_schedule(),
            policy=DraftLengthPolicy(
                k,
                full_graph_tokens=full_graph_tokens(vllm_config),
                max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
            ),
        )
        setattr(self, _CONTROLLER, ctl)
        stock_schedule = self.schedule
        stock_update = self.update_from_output

        def schedule(*a, **kw):
            return ctl.schedule(lambda: stock_schedule(*a, **kw))

        def update_from_output(scheduler_output, model_runner_output):
            result = stock_update(scheduler_output, model_runner_output)
            ctl.observe(scheduler_output, model_runner_output)
            return result

        self.schedule = schedule
        self.update_from_output = update_from_output
        logger.info(
            "DFlash adaptive draft length: each step verifies 0..%d drafts "
            "(candidates %s), chosen from measured step time and acceptance",
            ctl.k,
            list(ctl.policy.candidates),
        )

    replace_attr(Scheduler, "__init__", __init__, NAME)


CONFIG_PATCH = Patch(
    name=CONFIG_NAME,
    kind=PatchKind.FEATURE,
    targets=("vllm.engine.arg_utils:EngineArgs.create_engine_config",),
    summary=(
        "speculative_config accepts 'draft_length' ('fixed' | 'adaptive') for "
        "DFlash, validated with a one-line error before weights load."
    ),
    why=(
        "vLLM's SpeculativeConfig forbids unknown keys; the key is moved to "
        "VllmConfig.additional_config['vllm_dflash'] for the engine core."
    ),
    upstream="none, vllm-dflash feature (upstream: dynamic speculation length, V2 runner only, #32374)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=config_probe,
    apply=config_apply,
    future="Keep while no vLLM release has a per-step draft length for V1 DFlash.",
    probe_false_reason="SpeculativeConfig has a draft_length field of its own",
)

PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=("vllm.v1.core.sched.scheduler:Scheduler.__init__",),
    summary=(
        "'draft_length': 'adaptive': each step verifies the number of DFlash drafts "
        "(0..k) that maximises measured tokens per second for the batch."
    ),
    why=(
        "A fixed k is slower than no speculation once the batch makes the verify "
        "compute bound (H200, 8B pair, acceptance 3.5: 0.86x at 64 requests, 0.63x "
        "at 128)."
    ),
    upstream="none for V1 (dynamic speculation length is V2-runner only: #32374, #45953)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=scheduler_probe,
    apply=scheduler_apply,
    future="Keep while no vLLM release has a per-step draft length for V1 DFlash.",
    probe_false_reason="the scheduler sets the draft length per step itself",
)
