# SPDX-License-Identifier: Apache-2.0
"""The patch registry: declaration, probing and idempotent application.

Each patch is data (:class:`Patch`): what vLLM symbol it changes, why, the
upstream PR, the vLLM versions it applies to, a probe that tells whether the
running vLLM still needs it, how to apply it, and the future plan. The same
records feed ``register()``, ``vllm-dflash doctor`` and the README table.
"""

from __future__ import annotations

import enum
import multiprocessing
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet

from vllm_dflash import envs
from vllm_dflash.compat import (
    VERIFIED_VLLM,
    is_supported_vllm,
    platform_name,
    vllm_version,
    vllm_version_str,
)

_MARK = "__vllm_dflash_patch__"


class PatchError(RuntimeError):
    """A patch could not be applied (target missing or changed)."""


class PatchState(str, enum.Enum):
    APPLIED = "applied"
    NOT_NEEDED = "not needed"  # the running vLLM already has the fix
    NOT_APPLICABLE = "not applicable"  # other vLLM version or platform
    DISABLED = "disabled"  # VLLM_DFLASH_DISABLE
    FAILED = "failed"


@dataclass(frozen=True)
class Patch:
    name: str
    targets: tuple[str, ...]  # "module:Qualified.name" of each vLLM symbol changed
    summary: str  # what it changes
    why: str
    upstream: str  # upstream PR, or "none, CPU backend defect"
    versions: str  # PEP 440 specifier of vLLM versions it applies to
    platforms: tuple[str, ...]  # vLLM device types ("cpu", "cuda", ...)
    probe: Callable[[], bool]  # True if the running vLLM still needs this patch
    apply: Callable[[], None]  # idempotent
    future: str  # plan: when it can be deleted
    kind: str = "fix"  # "backport", "cpu", "feature"
    # State and reason when the probe says False (default: upstream has the fix).
    when_probe_false: PatchState = PatchState.NOT_NEEDED
    probe_false_reason: str = "probe: the running vLLM already has this fix"

    def applies_to_version(self) -> bool:
        return vllm_version() in SpecifierSet(self.versions)


@dataclass(frozen=True)
class PatchResult:
    name: str
    state: PatchState
    reason: str = ""


_lock = threading.Lock()
_results: dict[str, PatchResult] = {}
_applied_pid: int | None = None


def evaluate(patch: Patch, apply: bool) -> PatchResult:
    """Decide a patch's state; apply it if needed and ``apply`` is set."""
    if patch.name in envs.disabled_patches():
        return PatchResult(patch.name, PatchState.DISABLED, "VLLM_DFLASH_DISABLE")
    if not patch.applies_to_version():
        return PatchResult(
            patch.name,
            PatchState.NOT_APPLICABLE,
            f"vLLM {vllm_version_str()} not in {patch.versions}",
        )
    if platform_name() not in patch.platforms:
        return PatchResult(
            patch.name,
            PatchState.NOT_APPLICABLE,
            f"platform {platform_name()} not in {list(patch.platforms)}",
        )
    try:
        needed = patch.probe()
    except Exception as e:  # the target moved: never guess
        raise PatchError(
            f"vllm-dflash patch {patch.name!r} cannot probe vLLM "
            f"{vllm_version_str()} ({patch.targets}): {type(e).__name__}: {e}"
        ) from e
    if not needed:
        return PatchResult(patch.name, patch.when_probe_false, patch.probe_false_reason)
    if apply:
        try:
            patch.apply()
        except Exception as e:
            raise PatchError(
                f"vllm-dflash patch {patch.name!r} failed on vLLM "
                f"{vllm_version_str()} ({patch.targets}): {type(e).__name__}: {e}. "
                f"Disable it with VLLM_DFLASH_DISABLE={patch.name} at your own risk."
            ) from e
    return PatchResult(patch.name, PatchState.APPLIED)


def apply_all(raise_on_error: bool = True) -> dict[str, PatchResult]:
    """Apply every registered patch once per process (idempotent)."""
    global _applied_pid
    from vllm_dflash.logger import init_logger
    from vllm_dflash.patches.catalog import PATCHES

    logger = init_logger("vllm_dflash")
    with _lock:
        if _applied_pid == os.getpid() and _results:
            return dict(_results)
        if not is_supported_vllm():
            logger.warning(
                "vllm-dflash is verified on vLLM %s (ci/matrix.toml); found %s: "
                "no patch applied (DFlash runs as stock vLLM would run it).",
                ", ".join(VERIFIED_VLLM),
                vllm_version_str(),
            )
            for p in PATCHES:
                _results[p.name] = PatchResult(
                    p.name, PatchState.NOT_APPLICABLE, "unsupported vLLM version"
                )
            _applied_pid = os.getpid()
            return dict(_results)
        for p in PATCHES:
            try:
                _results[p.name] = evaluate(p, apply=True)
            except PatchError as e:
                _results[p.name] = PatchResult(p.name, PatchState.FAILED, str(e))
                if raise_on_error:
                    raise
        _applied_pid = os.getpid()
        applied = [n for n, r in _results.items() if r.state is PatchState.APPLIED]
        logger.info(
            "vllm-dflash %s on vLLM %s (%s) in %s[%d]: applied %s",
            _plugin_version(),
            vllm_version_str(),
            platform_name(),
            multiprocessing.current_process().name,
            os.getpid(),
            ", ".join(applied) or "nothing",
        )
        return dict(_results)


def _plugin_version() -> str:
    from vllm_dflash.version import __version__

    return __version__


# --- helpers used by patch modules -------------------------------------------


def replace_attr(
    owner: Any, attr: str, new: Any, patch_name: str, add: bool = False
) -> None:
    """Set ``owner.attr = new`` once; a second call is a no-op.

    Raises if the attribute does not exist (the target moved upstream), unless
    ``add`` says the patch adds a missing method.
    """
    current = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if current is None:
        current = getattr(owner, attr, None) if add else getattr(owner, attr)
    if getattr(current, _MARK, None) == patch_name:
        return
    try:
        setattr(new, _MARK, patch_name)
        if current is not None and callable(new) and not isinstance(new, type):
            new.__wrapped_original__ = current
    except (AttributeError, TypeError):
        pass
    setattr(owner, attr, new)


def original(obj: Any) -> Any:
    """The vLLM object a patch replaced (or ``obj`` itself if unpatched)."""
    return getattr(obj, "__wrapped_original__", obj)


def is_patched(obj: Any, patch_name: str) -> bool:
    return getattr(obj, _MARK, None) == patch_name
