"""Whole programs a test module checks from outside (the demo, the CPU recipe): each one a subprocess with a Ray
cluster of its own, that the module's tests only read the output of.

They are started when the session starts (:func:`conftest.program_runs`), beside the unit tier, which keeps only one
of a 2-core machine's cores busy, at most :data:`MAX_RUNNING` at once (each is a trainer with its vLLM engine: more
at once would not fit the machine's memory), the next one as one ends; the module's fixture then waits for its run.
A run the session did not start (the module was collected alone, or vLLM is missing) is started by the fixture
itself. Either way the program, its arguments and its deadline (from its own start) are the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


#: Program runs at once: one. Each is a trainer with one or two vLLM engines (4-6 GB of this 24 GB machine); two at
#: once beside the shared part's engines and an in-process trainer went past Ray's memory threshold (95%), whose
#: monitor then killed workers of the runs and of the tests. Both cores stay busy either way.
MAX_RUNNING = 1


@dataclass(frozen=True)
class Command:
    """One program run: ``argv`` in ``cwd`` with ``env``, killed ``timeout_s`` after it started."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]
    timeout_s: float


@dataclass
class Finished:
    command: Command
    returncode: int
    stdout: str
    stderr: str


@dataclass
class _Running:
    command: Command
    proc: subprocess.Popen
    out: Path
    err: Path
    started: float = field(default_factory=time.monotonic)


class ProgramRuns:
    """The session's program runs, by name, started in the order given, :data:`MAX_RUNNING` at once; each is waited
    for once (:meth:`finish`)."""

    def __init__(self, max_running: int = MAX_RUNNING) -> None:
        self._runs: dict[str, _Running] = {}
        self._queue: list[tuple[str, Command]] = []
        self._max_running = max_running
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pump: threading.Thread | None = None

    def start(self, name: str, command: Command) -> None:
        """Start ``name`` now if fewer than ``max_running`` run, else as soon as one ends."""
        with self._lock:
            self._queue.append((name, command))
            self._start_queued()
            if self._queue and (self._pump is None or not self._pump.is_alive()):
                self._pump = threading.Thread(target=self._start_as_they_end, daemon=True, name="program-runs")
                self._pump.start()

    def finish(self, name: str, make_command: Callable[[], Command]) -> Finished:
        """Wait for the run ``name`` (started now with ``make_command()`` if the session did not queue it) and return
        what it printed; past its deadline its process group is killed and ``subprocess.TimeoutExpired`` raised."""
        with self._lock:
            queued = any(n == name for n, _ in self._queue)
        if name not in self._runs and not queued:
            self.start(name, make_command())
        with self._changed:
            self._changed.wait_for(lambda: name in self._runs)
            run = self._runs.pop(name)
        try:
            run.proc.wait(timeout=max(0.0, run.started + run.command.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(run.proc)
            raise
        return Finished(run.command, run.proc.returncode, run.out.read_text(), run.err.read_text())

    def stop_all(self) -> None:
        """Kill the runs no test waited for (a deselected or failed module), and drop those not started."""
        with self._lock:
            self._queue.clear()
            for run in self._runs.values():
                _kill(run.proc)
            self._runs.clear()

    def _start_queued(self) -> None:
        """Start queued runs while fewer than ``max_running`` run (the lock held)."""
        while self._queue and sum(r.proc.poll() is None for r in self._runs.values()) < self._max_running:
            name, command = self._queue.pop(0)
            logs = Path(tempfile.mkdtemp(prefix=f"{name}_logs_"))
            out, err = logs / "stdout.txt", logs / "stderr.txt"
            with open(out, "w") as stdout, open(err, "w") as stderr:  # the child holds its own copies
                proc = subprocess.Popen(command.argv, cwd=command.cwd, env=command.env, stdout=stdout, stderr=stderr,
                                        text=True, start_new_session=True)
            self._runs[name] = _Running(command, proc, out, err)
            self._changed.notify_all()

    def _start_as_they_end(self) -> None:
        while True:
            with self._lock:
                self._start_queued()
                if not self._queue:
                    return
            time.sleep(1.0)


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (a run that started a server in a session of its own stops it then), SIGKILL
    15 s later if it is still there."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 60)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def recipe_command(request, folder: str, *overrides: str, env: dict[str, str] | None = None) -> Command:
    """``bash recipes/grpo_cpu_tiny.sh trainer.logger=[console,file] <overrides>`` as a user runs it (the demo's tiny
    models and data: no path set), in a folder of its own with verl's file logger writing ``metrics.jsonl`` there;
    ``env``: more of its environment (``RM_PLACEMENT``, a ``PYTHONPATH``...)."""
    import sys

    from conftest import REPO_ROOT

    tiny_models = request.getfixturevalue("tiny_models")
    out = request.getfixturevalue("tmp_path_factory").mktemp(folder)
    base = {k: v for k, v in os.environ.items() if k not in ("POLICY_PATH", "RM_PATH", "TRAIN_FILE", "VAL_FILE")}
    base.update(PATH=os.pathsep.join([os.path.dirname(sys.executable), base.get("PATH", "")]),
                VERL_ASYNC_RM_CACHE=str(tiny_models.root.parent), VERL_FILE_LOGGER_PATH=str(out / "metrics.jsonl"))
    argv = ["bash", str(REPO_ROOT / "recipes" / "grpo_cpu_tiny.sh"), "trainer.logger=[console,file]", *overrides]
    return Command(argv, cwd=out, env={**base, **(env or {})}, timeout_s=840)


def logged_steps(metrics_file: Path) -> dict[int, dict]:
    """verl's file logger's rows, by step: ``{step: metrics}``."""
    import json

    return {row["step"]: row["data"] for row in map(json.loads, metrics_file.read_text().splitlines()) if row}
