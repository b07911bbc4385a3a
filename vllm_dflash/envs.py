# SPDX-License-Identifier: Apache-2.0
"""Environment variables read by vllm-dflash (all optional)."""

import os

# Comma-separated patch names to leave unapplied, e.g. "dflash_aux_layer_shift".
VLLM_DFLASH_DISABLE = "VLLM_DFLASH_DISABLE"
# Path of a JSONL file; when set, each drafting step appends one line per request.
VLLM_DFLASH_TRACE = "VLLM_DFLASH_TRACE"


def disabled_patches() -> frozenset[str]:
    raw = os.environ.get(VLLM_DFLASH_DISABLE, "")
    return frozenset(p.strip() for p in raw.split(",") if p.strip())


def trace_path() -> str | None:
    return os.environ.get(VLLM_DFLASH_TRACE) or None


# Path of a JSON file; when set, GPU workers time the sections of each DFlash
# step (device-synchronised: a measuring aid, not for production).
VLLM_DFLASH_PROFILE = "VLLM_DFLASH_PROFILE"


def profile_path() -> str | None:
    return os.environ.get(VLLM_DFLASH_PROFILE) or None


# Path of a JSONL file; when set, the engine core appends one line per engine
# step (requests, tokens, drafts verified, wall time; no device sync).
VLLM_DFLASH_STEP_LOG = "VLLM_DFLASH_STEP_LOG"


def step_log_path() -> str | None:
    return os.environ.get(VLLM_DFLASH_STEP_LOG) or None


# Path of a JSONL file; when set, DFlash GPU workers append one line per Triton
# kernel variant compiled after their start-up warm-up (dflash_jit_warmup).
VLLM_DFLASH_JIT_LOG = "VLLM_DFLASH_JIT_LOG"


def jit_log_path() -> str | None:
    return os.environ.get(VLLM_DFLASH_JIT_LOG) or None


# Comma-separated draft lengths, e.g. "4,0,0,2": with "draft_length": "adaptive",
# the scheduler verifies these lengths in turn instead of choosing (a test aid
# that exercises every transition deterministically).
VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE = "VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE"


def _draft_lengths(name: str, expected: str) -> tuple[int, ...] | None:
    """Comma-separated non-negative integers from ``name`` (None when unset); a
    malformed value raises one line naming the variable, the value and
    ``expected``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return values


def draft_length_schedule() -> tuple[int, ...] | None:
    return _draft_lengths(
        VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE,
        "comma-separated non-negative integers, e.g. 4,0,0,2",
    )
