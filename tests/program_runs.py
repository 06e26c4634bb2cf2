"""Whole programs a test module checks from outside (the demo, the CPU recipe): each one a subprocess with a Ray
cluster of its own, that the module's tests only read the output of.

They are started when the session starts (:func:`conftest.program_runs`), beside the unit tier, which keeps only one
of a 2-core machine's cores busy; the module's fixture then waits for its run. A run the session did not start (the
module was collected alone, or vLLM is missing) is started by the fixture itself. Either way the program, its
arguments and its deadline are the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


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
    """The session's program runs, by name; each is waited for once (:meth:`finish`)."""

    def __init__(self) -> None:
        self._runs: dict[str, _Running] = {}

    def start(self, name: str, command: Command) -> None:
        logs = Path(tempfile.mkdtemp(prefix=f"{name}_logs_"))
        out, err = logs / "stdout.txt", logs / "stderr.txt"
        with open(out, "w") as stdout, open(err, "w") as stderr:  # the child holds its own copies
            proc = subprocess.Popen(command.argv, cwd=command.cwd, env=command.env, stdout=stdout, stderr=stderr,
                                    text=True, start_new_session=True)
        self._runs[name] = _Running(command, proc, out, err)

    def finish(self, name: str, make_command: Callable[[], Command]) -> Finished:
        """Wait for the run ``name`` (started now with ``make_command()`` if the session did not start it) and return
        what it printed; past its deadline its process group is killed and ``subprocess.TimeoutExpired`` raised."""
        if name not in self._runs:
            self.start(name, make_command())
        run = self._runs.pop(name)
        try:
            run.proc.wait(timeout=max(0.0, run.started + run.command.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(run.proc)
            raise
        return Finished(run.command, run.proc.returncode, run.out.read_text(), run.err.read_text())

    def stop_all(self) -> None:
        """Kill the runs no test waited for (a deselected or failed module)."""
        for run in self._runs.values():
            _kill(run.proc)
        self._runs.clear()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
