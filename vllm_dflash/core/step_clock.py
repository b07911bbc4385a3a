# SPDX-License-Identifier: Apache-2.0
"""The wall-clock time of engine steps, without a device sync.

A step's time runs from the later of its scheduling and the previous step's
output to its own output: under asynchronous scheduling the next step is
scheduled before the current one's output arrives, so this is the interval
between outputs; without it, it is the step from scheduling to output. Used by
the adaptive draft length (its cost measurements) and by ``VLLM_DFLASH_STEP_LOG``
(one clock for both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StepTime(Generic[T]):
    payload: T
    seconds: float
    after_output: bool  # a previous step's output bounded it (not the first step)


class StepClock(Generic[T]):
    """Pairs each scheduler output with the model output that answers it."""

    def __init__(self) -> None:
        self._scheduled: dict[int, tuple[float, T]] = {}
        self._last_output: float | None = None

    def scheduled(self, out: Any, payload: T, at: float | None = None) -> None:
        """``out`` was scheduled (at ``at``, a ``time.perf_counter()``; now if
        not given)."""
        self._scheduled[id(out)] = (time.perf_counter() if at is None else at, payload)

    def output(self, out: Any) -> StepTime[T] | None:
        """The output of ``out`` arrived: its payload and time (None if ``out``
        was not recorded as scheduled)."""
        now = time.perf_counter()
        last, self._last_output = self._last_output, now
        entry = self._scheduled.pop(id(out), None)
        if entry is None:
            return None
        at, payload = entry
        start = at if last is None else max(last, at)
        return StepTime(payload, now - start, last is not None)
