"""What the benchmark ran on: package version and commit, verl/ray/torch versions, Python, CPUs, load average."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["environment_snapshot"]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> dict[str, Any]:
    """The git commit of the source tree this package is imported from (None when it is not a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=here, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False,
                               cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def environment_snapshot() -> dict[str, Any]:
    """A JSON-serialisable record of the software and machine."""
    import verl_async_rm

    return {
        "verl_async_rm": verl_async_rm.__version__,
        **_commit(),
        "source": str(Path(verl_async_rm.__file__).resolve().parent),
        "verl": _version("verl"),
        "ray": _version("ray"),
        "torch": _version("torch"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_1min": _load(),
    }
