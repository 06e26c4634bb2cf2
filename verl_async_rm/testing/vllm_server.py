"""vLLM's own OpenAI-compatible server (``vllm.entrypoints.openai.api_server``) for tests and benchmarks: a subprocess
on 127.0.0.1 in a process group of its own, serving one tiny model on CPU (or a GPU where there is one), stopped
with its whole group. What a remote RM's tests talk to, as a user's judge or RM server."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VLLMServer", "start_vllm_server", "free_port"]

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    """A running server: its base URL (``.../v1``), the model name it serves, its process and log file."""

    url: str
    model: str
    process: subprocess.Popen
    log: Path

    def stop(self, wait_s: float = 30.0) -> None:
        """Stop the server and every process it started (idempotent)."""
        if self.process.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_vllm_server(model_path: str | os.PathLike, *, name: str, log_dir: str | os.PathLike,
                      args: tuple[str, ...] = (), start_timeout_s: float = 600.0) -> VLLMServer:
    """Start vLLM's server for ``model_path`` as model ``name`` on a free port of 127.0.0.1 and wait until it answers
    ``/health`` (at most ``start_timeout_s``; ``RuntimeError`` with its log's end if it dies or does not come up).
    ``args``: more of vLLM's server flags (``--max-logprobs``, ``--structured-outputs-config``...)."""
    port = free_port()
    log = Path(log_dir) / f"vllm-{name}-{port}.log"
    env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--model", str(model_path), "--served-model-name", name, "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--max-num-seqs", "8", "--disable-log-stats", *args]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    server = VLLMServer(f"http://127.0.0.1:{port}/v1", name, process, log)
    t0, deadline = time.monotonic(), time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    logger.info("vLLM server %s up in %.1f s at %s", name, time.monotonic() - t0, server.url)
                    return server
        except OSError:
            time.sleep(1.0)
    server.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"vLLM's server for {model_path} did not come up within {start_timeout_s:g} s "
                       f"(exit code {process.poll()}); the end of {log}:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_async_rm.testing.vllm_server --model DIR --name NAME [--log-dir D] [--arg=FLAG ...] -- CMD...``:
    run ``CMD`` while vLLM's server serves ``DIR`` on 127.0.0.1, ``{endpoint}`` in its arguments replaced by the
    server's base URL; the server is stopped when ``CMD`` ends; exit status: ``CMD``'s. The CPU recipe's run with a
    remote judge in the tests is launched this way."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m verl_async_rm.testing.vllm_server", description=main.__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--arg", action="append", default=[], help="one more server flag (repeat)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("give the command to run after --")
    log_dir = options.log_dir or tempfile.mkdtemp(prefix="vllm_server_")
    # the server runs in a session of its own: a SIGTERM to this process (group) must stop it too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with start_vllm_server(options.model, name=options.name, log_dir=log_dir, args=tuple(options.arg)) as server:
        print(f"vLLM server {server.model} at {server.url} (log: {server.log})", flush=True)
        return subprocess.call([part.replace("{endpoint}", server.url) for part in command])


if __name__ == "__main__":
    sys.exit(main())
