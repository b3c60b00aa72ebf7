"""A throwaway ``redis-server`` on 127.0.0.1 for tests and benchmarks.

The server listens on a free port, keeps nothing on disk (``--save ""``,
``--appendonly no``, its working directory is a temporary one) and is stopped by the
PID this process started, never by name.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

SERVER_BINARY = "redis-server"


def server_binary() -> str | None:
    """Path of ``redis-server`` (or ``valkey-server``), or None when neither is installed."""
    return shutil.which(SERVER_BINARY) or shutil.which("valkey-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """Start with :meth:`start` (or ``with RedisServer() as server``), connect to :attr:`url`."""

    def __init__(self, binary: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        found = binary or server_binary()
        if found is None:
            raise FileNotFoundError(
                "redis-server is not installed (apt-get install redis-server, or brew install redis)"
            )
        self.binary = found
        self.extra_args = extra_args
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Launch the server and wait until it answers PING; raise with its log if it does not."""
        self._workdir = tempfile.TemporaryDirectory(prefix="tierkv-redis-")
        log = Path(self._workdir.name) / "redis.log"
        for _ in range(5):  # a port found free can be taken before the server binds it: retry
            self.port = free_port()
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self._workdir.name, "--logfile", str(log), "--daemonize", "no", *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.process.poll() is None:
                if self._pong():
                    return self
                time.sleep(0.02)
            self._terminate()
        detail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        self.stop()
        raise RuntimeError(f"{self.binary} did not start on 127.0.0.1; its log ends with:\n{detail}")

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server by its PID and remove its working directory. Idempotent."""
        self._terminate()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()
