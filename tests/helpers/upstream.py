# SPDX-License-Identifier: Apache-2.0
"""Apply patches/ diffs to a copy of the installed vLLM package."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def installed_vllm_root() -> Path:
    """The directory holding the installed ``vllm/`` package."""
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


def diffs_for(version: str) -> list[Path]:
    """The diffs ci/matrix.toml assigns to this vLLM version (release part only)."""
    from ci.matrix import load_matrix

    spec = load_matrix()["versions"].get(version.split("+")[0])
    if spec is None:
        return []
    return sorted((ROOT / spec["patches"]).glob("*.diff"))


def touched_files(diff: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", diff.read_text(), flags=re.M)


def run_patch(diff: Path, cwd: Path, dry_run: bool) -> subprocess.CompletedProcess:
    cmd = ["patch", "-p1", "--forward", "--batch"] + (["--dry-run"] if dry_run else [])
    return subprocess.run(
        cmd, cwd=cwd, input=diff.read_text(), capture_output=True, text=True
    )


def patched_copy(version: str, dest: Path) -> Path:
    """Hard-link copy of the installed vllm/ with the diffs applied to real copies."""
    src = installed_vllm_root() / "vllm"
    shutil.copytree(src, dest / "vllm", copy_function=os.link)
    copied: set[str] = set()
    for diff in diffs_for(version):
        for rel in touched_files(diff):
            if rel in copied:  # an earlier diff already changed this file
                continue
            target = dest / rel
            # a real copy, never written through a hard link (a file the diff
            # creates is not there yet: patch creates it)
            if target.exists():
                target.unlink()
                shutil.copy2(src.parent / rel, target)
            copied.add(rel)
        res = run_patch(diff, dest, dry_run=False)
        if res.returncode != 0:
            raise RuntimeError(f"{diff.name} failed:\n{res.stdout}{res.stderr}")
    return dest
