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



def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """Stop a server we started, by its PID: terminate, then kill if it does not exit."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)

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
        stop_process(process)

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


def cluster_ports(count: int) -> list[int]:
    """``count`` free ports whose cluster-bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


class RedisClusterServers:
    """A Redis Cluster of ``nodes`` masters on 127.0.0.1 (no replicas), each stopped by its PID.

    Nodes run with ``cluster-require-full-coverage no``: with one node down, the others go on
    serving their slots (the setting a cache cluster wants). :meth:`stop_node` and
    :meth:`start_node` take one node down and bring it back on the same port and node id.
    """

    def __init__(self, nodes: int = 3, binary: str | None = None, node_timeout_ms: int = 1000) -> None:
        found = binary or server_binary()
        if found is None or shutil.which("redis-cli") is None:
            raise FileNotFoundError("redis-server and redis-cli are not installed (apt-get install redis-server)")
        self.binary = found
        self.count = nodes
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """A seed: the first node (the client learns the others)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    @property
    def seeds(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def start(self, timeout_s: float = 30.0) -> RedisClusterServers:
        self._workdir = tempfile.TemporaryDirectory(prefix="tierkv-redis-cluster-")
        self.ports = cluster_ports(self.count)
        try:
            for port in self.ports:
                self.start_node(port, timeout_s)
            subprocess.run(["redis-cli", "--cluster", "create", *self.seeds, "--cluster-replicas", "0",
                            "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while not all(self._state_ok(port) for port in self.ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("the redis cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, port: int, timeout_s: float = 10.0) -> None:
        """(Re)start the node on ``port``; its nodes.conf brings it back into the cluster."""
        assert self._workdir is not None
        workdir = Path(self._workdir.name) / str(port)
        workdir.mkdir(exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--logfile", str(workdir / "redis.log"), "--daemonize", "no",
             "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf"),
             "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.processes[port].poll() is None:
            if self._reply(port, b"PING").startswith(b"+PONG"):
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.binary} did not start on 127.0.0.1:{port}")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node reports cluster_state:ok."""
        deadline = time.monotonic() + timeout_s
        while not all(self._state_ok(port) for port in self.processes):
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def _reply(self, port: int, command: bytes) -> bytes:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(command + b"\r\n")
                return conn.recv(4096)
        except OSError:
            return b""

    def _state_ok(self, port: int) -> bool:
        return b"cluster_state:ok" in self._reply(port, b"CLUSTER INFO")

    def stop_node(self, port: int) -> None:
        """Stop one node by its PID (its slots' chunks become misses)."""
        stop_process(self.processes.pop(port, None))

    def stop(self) -> None:
        """Stop every node by PID and remove the working directories. Idempotent."""
        for port in list(self.processes):
            self.stop_node(port)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()
