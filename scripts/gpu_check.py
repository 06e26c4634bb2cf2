"""The GPU check's stages, run by ``scripts/gpu_check.sh`` (read that first): each stage a subprocess with its own time
limit, cut to what is left of the whole budget; the figures go to ``$OUT/gpu_check.json`` after every stage, so a run
cut short still returns what it measured.

Without CUDA (the rehearsal on a CPU machine) the benchmarks run on the ``tiny`` shape on the CPU and ``tests/gpu``
skips: everything but the GPU itself is exercised.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START = time.monotonic()


def _budget_left(budget_s: float) -> float:
    return budget_s - (time.monotonic() - START)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_stage(name: str, argv: list[str], limit_s: float, budget_s: float, env: dict[str, str] | None = None,
              min_s: float = 30.0) -> dict[str, Any]:
    """Run ``argv`` with at most ``limit_s`` seconds (less if the budget has less); skipped under ``min_s`` left."""
    left = _budget_left(budget_s)
    if left < min_s:
        return {"status": "skipped", "why": f"{left:.0f} s of the budget left (needs {min_s:.0f})"}
    timeout = min(limit_s, left)
    print(f"\n=== {name}: {' '.join(argv)} (limit {timeout:.0f} s)", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        print(out, flush=True)
        return {"status": "timeout", "seconds": round(time.monotonic() - started, 1), "tail": _tail(out)}
    print(done.stdout, done.stderr, sep="\n", flush=True)
    return {"status": "ok" if done.returncode == 0 else "failed", "rc": done.returncode,
            "seconds": round(time.monotonic() - started, 1), "tail": _tail(done.stdout + done.stderr),
            "last_line": (done.stdout.strip().splitlines() or [""])[-1]}


def environment() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                    device_count=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
    for module in ("ray", "verl", "vllm", "verl_async_rm"):
        try:
            info[module] = __import__(module).__version__
        except Exception as err:  # noqa: BLE001 - a missing package is a recorded fact here, not an error
            info[module] = f"not importable: {type(err).__name__}"
    return info


# What verl sees on this machine once the plugin's entry point has loaded: on a GPU machine verl's own nvidia platform
# (device cuda, backend nccl) and the plugin's CPU platform off; on a CPU machine the CPU platform (cpu, gloo).
VERL_PLATFORM = """
import json, sys
import verl
from verl.utils.device import get_device_name, get_nccl_backend
from verl_async_rm import cpu_platform
print(json.dumps({"device_name": get_device_name(), "backend": get_nccl_backend(),
                  "plugin_loaded": "verl_async_rm.plugin" in sys.modules, "cpu_platform": cpu_platform.is_active()}))
"""


def verl_platform(budget_s: float) -> dict[str, Any]:
    result = run_stage("verl platform", [sys.executable, "-c", VERL_PLATFORM], 120, budget_s)
    if result["status"] == "ok":
        result["seen"] = json.loads(result["last_line"])
        import torch

        want = "cuda" if torch.cuda.is_available() else None
        result["unchanged_on_gpu"] = None if want is None else (
            result["seen"]["device_name"] == want and result["seen"]["backend"] == "nccl"
            and not result["seen"]["cpu_platform"])
    return result


def bench_rm(shape: str, requests: int, out: Path, limit_s: float, budget_s: float, cuda: bool) -> dict[str, Any]:
    """``bench rm`` fresh and steady against the dense bound, GRPO groups of 8 (the shared-prompt gain)."""
    folder = out / f"bench_rm_{shape}"
    argv = [sys.executable, "-m", "verl_async_rm", "bench", "rm", "--shape", shape, "--requests", str(requests),
            "--rollout-n", "8", "--out", str(folder)]
    if not cuda:
        argv += ["--device", "cpu"]
    result = run_stage(f"bench rm {shape}", argv, limit_s, budget_s)
    report = folder / "bench_rm.json"
    if report.exists():
        result["report"] = json.loads(report.read_text())
    return result


def pytest_stage(name: str, targets: list[str], out: Path, limit_s: float, budget_s: float,
                 extra: list[str] | None = None) -> dict[str, Any]:
    junit = out / f"{name}.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "log_cli=true",
            "-o", "log_cli_level=INFO", f"--junitxml={junit}", *targets, *(extra or [])]
    return run_stage(name, argv, limit_s, budget_s, env={"VERL_ASYNC_RM_GPU_OUT": str(out)})


def main() -> int:
    out = Path(os.environ.get("OUT") or ROOT / "out" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    budget_s = float(os.environ.get("GPU_CHECK_BUDGET_S", "420"))
    summary: dict[str, Any] = {"budget_s": budget_s, "environment": environment(), "stages": {}}
    cuda = bool(summary["environment"]["cuda_available"])
    path = out / "gpu_check.json"

    def save(name: str, result: dict[str, Any]) -> None:
        summary["stages"][name] = result
        summary["elapsed_s"] = round(time.monotonic() - START, 1)
        path.write_text(json.dumps(summary, indent=1, default=str) + "\n")

    save("verl_platform", verl_platform(budget_s))
    # Most important first: the scorer against the dense bound on the 8B shape (target >= 0.97 fresh) and the GRPO
    # shared-prompt gain (>= 1.5x); then every CUDA path's correctness; then the layout model's figures.
    big, small = ("llama8b", "qwen0.5b") if cuda else ("tiny", "tiny")
    save("bench_rm_8b", bench_rm(big, 256 if cuda else 64, out, 150, budget_s, cuda))
    save("tests_gpu_rm", pytest_stage("tests_gpu_rm", ["tests/gpu/test_rm_gpu.py"], out, 150, budget_s,
                                      ["--deselect", "tests/gpu/test_rm_gpu.py::test_bench_rm_fresh_lengths_cost_no_stall"]))
    save("bench_rm_0p5b", bench_rm(small, 512 if cuda else 64, out, 75, budget_s, cuda))
    save("tests_gpu_colocation", pytest_stage("tests_gpu_colocation", ["tests/gpu/test_colocation_gpu.py"], out, 180,
                                              budget_s))
    failed = [name for name, stage in summary["stages"].items() if stage["status"] not in ("ok", "skipped")]
    summary["failed"] = failed
    save("done", {"status": "ok", "elapsed_s": round(time.monotonic() - START, 1)})
    print(f"\ngpu_check: {len(summary['stages']) - 1} stages in {summary['elapsed_s']} s, failed: {failed or 'none'};"
          f" figures in {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
