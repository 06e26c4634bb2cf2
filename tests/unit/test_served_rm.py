"""What :mod:`verl_async_rm.demo.served_rm` adds around verl's router start (the real-vLLM tests run the whole served
RM): the spawn start method within ``router_spawned`` only, and the bounded wait for the router's port."""

from __future__ import annotations

import multiprocessing
import socket

import pytest

from verl_async_rm.demo.served_rm import router_spawned, wait_for_router

pytestmark = pytest.mark.unit


def test_the_router_is_spawned_and_the_start_method_restored():
    before = multiprocessing.get_start_method(allow_none=True)
    with router_spawned():
        assert multiprocessing.get_start_method() == "spawn"
    assert multiprocessing.get_start_method(allow_none=True) == before
    with pytest.raises(RuntimeError), router_spawned():
        raise RuntimeError("verl's start failed")
    assert multiprocessing.get_start_method(allow_none=True) == before


def test_the_wait_ends_when_the_router_listens_and_names_it_when_it_does_not():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        wait_for_router(address, timeout_s=5)
    with pytest.raises(TimeoutError, match=rf"verl's reward router at {address} did not accept connections"):
        wait_for_router(address, timeout_s=0.5)
