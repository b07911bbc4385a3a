# SPDX-License-Identifier: Apache-2.0
"""The patch registry: declaration, probing and idempotent application.

Each patch is data (:class:`Patch`): what vLLM symbol it changes, why, the
upstream PR, the vLLM versions it applies to, a probe that tells whether the
running vLLM still needs it, how to apply it, and the future plan. The same
records feed ``register()``, ``vllm-dflash doctor`` and the patch table in docs/patches.md.
Each record lives beside the code it describes; ``vllm_dflash.catalog`` orders
them. This module knows no particular patch.
"""

from __future__ import annotations

import enum
import inspect
import logging
import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet

from vllm_dflash import envs, import_hooks
from vllm_dflash.compat import (
    VERIFIED_VLLM,
    is_supported_vllm,
    platform_name,
    vllm_version,
    vllm_version_str,
)

_MARK = "__vllm_dflash_patch__"

# The vLLM range patches declare, and the platform tuples they use.
V020 = ">=0.20.0,<0.24.0"
# The 0.20.x line only (0.20.0-0.20.2 share the code these patches change).
V020_ONLY = ">=0.20.0,<0.21.0"
CPU_ONLY = ("cpu",)
ALL_PLATFORMS = ("cuda", "cpu", "rocm")


class PatchError(RuntimeError):
    """A patch could not be applied (target missing or changed)."""


class PatchKind(str, enum.Enum):
    BACKPORT = "backport"  # an upstream vLLM fix, on a release that lacks it
    FIX = "fix"  # a vLLM defect DFlash hits, no upstream fix yet
    CPU = "cpu"  # a vLLM-CPU defect (DFlash on the CPU backend)
    FEATURE = "feature"  # a plugin feature (CLI, validation, trace, profile)


class PatchState(str, enum.Enum):
    APPLIED = "applied"
    NOT_NEEDED = "not needed"  # the running vLLM already has the fix
    NOT_APPLICABLE = "not applicable"  # other vLLM version or platform
    DISABLED = "disabled"  # VLLM_DFLASH_DISABLE
    FAILED = "failed"
    DEFERRED = "deferred"  # applied when its vLLM module is imported


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
    kind: PatchKind = PatchKind.FIX
    # State and reason when the probe says False (default: upstream has the fix).
    when_probe_false: PatchState = PatchState.NOT_NEEDED
    probe_false_reason: str = "probe: the running vLLM already has this fix"
    # The vLLM module whose import applies the patch, where it is not the first
    # target's: patches that wrap the same symbol must be applied in catalog order
    # (tests/unit/test_patch_chains.py), so a patch that wraps another one's
    # wrapper waits for that one's trigger.
    trigger: str | None = None

    def applies_to_version(self) -> bool:
        return vllm_version() in SpecifierSet(self.versions)

    @property
    def trigger_module(self) -> str:
        """The vLLM module whose import applies the patch (its first target's
        unless ``trigger`` names another)."""
        return self.trigger or self.targets[0].split(":")[0]


@dataclass(frozen=True)
class PatchResult:
    name: str
    state: PatchState
    reason: str = ""


_lock = threading.RLock()
_results: dict[str, PatchResult] = {}
_applied_pid: int | None = None


def _gate(patch: Patch) -> PatchResult | None:
    """The state decided without touching vLLM's modules, if any."""
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
    return None


def gate(patch: Patch) -> PatchResult | None:
    """The state of ``patch`` in any process where it is decided without vLLM's
    modules (disabled, version, platform); None where its probe decides. Lets
    one process (the engine core) know that a worker patch cannot be in force."""
    return _gate(patch)


def evaluate(patch: Patch, apply: bool) -> PatchResult:
    """Decide a patch's state; apply it if needed and ``apply`` is set."""
    gated = _gate(patch)
    if gated is not None:
        return gated
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


def apply_all(
    patches: Sequence[Patch], raise_on_error: bool = False, defer: bool = True
) -> dict[str, PatchResult]:
    """Apply ``patches`` once per process (idempotent).

    With ``defer``, a patch whose vLLM module this process has not imported
    yet is applied right after that import (``import_hooks``): the API
    server never imports the model runner for a worker-side patch.

    A patch that cannot apply is logged as an error with its reason and
    recorded as ``failed``; vLLM still starts, so a user who does not run
    DFlash is not stopped by it. Running DFlash with a failed patch is refused
    by :func:`raise_if_failed` (called when a DFlash config is built and when
    the drafter loads).
    """
    global _applied_pid
    with _lock:
        if _applied_pid == os.getpid() and _results:
            return dict(_results)
        _applied_pid = os.getpid()
        if not is_supported_vllm():
            _logger().warning(
                "vllm-dflash is verified on vLLM %s (ci/matrix.toml); found %s: "
                "no patch applied (DFlash runs as stock vLLM would run it).",
                ", ".join(VERIFIED_VLLM),
                vllm_version_str(),
            )
            for p in patches:
                _results[p.name] = PatchResult(
                    p.name, PatchState.NOT_APPLICABLE, "unsupported vLLM version"
                )
            return dict(_results)
        deferred: list[Patch] = []
        for p in patches:
            gated = _gate(p)
            if gated is None and defer and p.trigger_module not in sys.modules:
                _results[p.name] = PatchResult(
                    p.name, PatchState.DEFERRED, f"until {p.trigger_module} is imported"
                )
                deferred.append(p)
            else:
                _record(p, raise_on_error)
        _log_applied("applied", [p.name for p in patches], deferred)
    for p in deferred:
        import_hooks.when_imported(p.trigger_module, lambda p=p: _apply_deferred(p))
    return dict(_results)


def _record(patch: Patch, raise_on_error: bool = False) -> None:
    try:
        _results[patch.name] = evaluate(patch, apply=True)
    except PatchError as e:
        _results[patch.name] = PatchResult(patch.name, PatchState.FAILED, str(e))
        if raise_on_error:
            raise
        _logger().error("%s (DFlash will refuse to start)", e)


def _apply_deferred(patch: Patch) -> None:
    with _lock:
        if _results.get(patch.name, PatchResult("", PatchState.DEFERRED)).state is not (
            PatchState.DEFERRED
        ):
            return
        _record(patch)
        _log_applied(f"on import of {patch.trigger_module}, applied", [patch.name], [])


# What this process applied, logged at INFO only once it runs DFlash (an engine
# without DFlash gets them at DEBUG: its log is plain vLLM's).
_dflash_in_use = False
_pending: list[tuple[int, str]] = []  # (pid, line): a forked child drops its parent's


def _log_applied(what: str, names: list[str], deferred: list[Patch]) -> None:
    applied = [n for n in names if _results[n].state is PatchState.APPLIED]
    if not applied and not deferred:
        return
    process = multiprocessing.current_process().name
    waiting = f"; {len(deferred)} wait for their module's import" if deferred else ""
    line = (
        f"vllm-dflash {_plugin_version()} on vLLM {vllm_version_str()} "
        f"({platform_name()}) in {process}[{os.getpid()}]: {what} "
        f"{', '.join(applied) or 'nothing'}{waiting}"
    )
    if _dflash_in_use:
        _logger().info("%s", line)
    else:
        _pending.append((os.getpid(), line))
        _logger().debug("%s", line)


def dflash_in_use() -> bool:
    """Whether this process runs DFlash (see :func:`note_dflash_in_use`)."""
    return _dflash_in_use


def note_dflash_in_use() -> None:
    """This process runs DFlash: log what it applied so far at INFO, and what it
    applies later as it happens. Called where only a DFlash engine goes: its
    config's validation (front end), its scheduler's start (engine core) and its
    drafter's load (worker)."""
    global _dflash_in_use
    with _lock:
        if _dflash_in_use:
            return
        _dflash_in_use = True
        lines = [line for pid, line in _pending if pid == os.getpid()]
        _pending.clear()
        logger = _logger()
        if logger.isEnabledFor(logging.DEBUG):
            return  # already shown, at DEBUG
        for line in lines:
            logger.info("%s", line)


def _logger():
    from vllm_dflash.logger import init_logger

    return init_logger("vllm_dflash")


def failed() -> list[PatchResult]:
    """The patches that failed in this process."""
    return [r for r in _results.values() if r.state is PatchState.FAILED]


def raise_if_failed() -> None:
    """Refuse to run DFlash when a patch failed in this process (called where a
    DFlash engine starts: so it also marks the process as running DFlash)."""
    note_dflash_in_use()
    bad = failed()
    if bad:
        raise PatchError(
            f"DFlash cannot run: vllm-dflash patch {bad[0].name!r} failed "
            f"({bad[0].reason}). Use a vLLM listed by `vllm-dflash doctor`, or "
            f"disable the patch with VLLM_DFLASH_DISABLE={bad[0].name}."
        )


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
        wrapper = callable(new) or isinstance(new, (classmethod, staticmethod))
        if current is not None and wrapper and not isinstance(new, type):
            new.__wrapped_original__ = current
    except (AttributeError, TypeError):
        pass
    setattr(owner, attr, new)


def original(obj: Any) -> Any:
    """The vLLM object patches replaced (or ``obj`` itself if unpatched): through
    every patch that wraps the same symbol."""
    while hasattr(obj, "__wrapped_original__"):
        obj = obj.__wrapped_original__
    return obj


def is_patched(obj: Any, patch_name: str) -> bool:
    return getattr(obj, _MARK, None) == patch_name


def code_reads(obj: Any, name: str) -> bool:
    """Whether the compiled code of ``obj`` (a function, a class's functions, or
    a module's classes and functions) uses ``name``: as an attribute or global,
    as a keyword argument in a call, or as the exact string given to
    ``getattr``. Comments and docstrings do not count and no source files are
    needed (probes must not read source text).
    """

    def walk(code: types.CodeType) -> bool:
        if name in code.co_names:
            return True
        for const in code.co_consts[1:]:  # [0] may be the docstring
            if const == name or (isinstance(const, tuple) and name in const):
                return True  # getattr(x, "name") / f(..., name=...)
        return any(isinstance(c, types.CodeType) and walk(c) for c in code.co_consts)

    if inspect.ismodule(obj):
        members = [
            m
            for m in vars(obj).values()
            if getattr(m, "__module__", None) == obj.__name__
            and (inspect.isclass(m) or inspect.isfunction(m))
        ]
    else:
        members = [obj]
    funcs: list[Any] = []
    for m in members:
        if inspect.isclass(m):
            funcs += [f for f in vars(m).values() if inspect.isfunction(f)]
        else:
            funcs.append(original(m))
    return any(walk(f.__code__) for f in funcs)
