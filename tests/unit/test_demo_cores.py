"""The demo's core split: the rollout and the RM on cores of their own (Linux CPU affinity)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from verl_async_rm.demo.cores import core_split, pin_processes

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs Linux CPU affinity and at least two cores")]


def test_the_cores_are_cut_in_two_disjoint_halves():
    rollout, rm = core_split()
    assert rollout and rm and not rollout & rm and rollout | rm == os.sched_getaffinity(0)


def test_every_thread_of_a_process_and_its_children_is_pinned():
    code = ("import subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(child.pid, flush=True); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        _, rm = core_split()
        assert pin_processes([proc.pid], rm) >= 3  # the parent's two threads and the child's
        for pid in (proc.pid, child):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == rm
    finally:
        if child is not None:
            os.kill(child, 9)
        proc.kill()
        proc.wait(timeout=10)


def test_a_process_that_is_gone_is_skipped():
    assert pin_processes([2**22 + 17], {0}) == 0
