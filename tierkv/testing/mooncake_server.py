"""A real Mooncake Store cluster on 127.0.0.1 for tests and benchmarks, stopped by PID.

``MooncakeCluster`` starts ``mooncake_master`` (with its embedded HTTP metadata
server) and one storage node, ``mooncake_client`` (the package's standalone process that
mounts a segment into the pool and holds it), each on free loopback ports. Clients (the
``mooncake`` tier) then mount nothing: chunks stay in the storage node when the process
that stored them exits, which is what sharing between serving nodes needs.

Mooncake binds some sockets itself beyond the addresses it is given (the metadata HTTP
server and the transfer engine's RPC listener may take every interface); tests must not
rely on those being loopback-only.

``MooncakeCluster.stop_master`` / ``MooncakeCluster.start_master`` simulate a
master outage and restart on the same ports (the storage node re-registers by itself;
the restarted master has forgotten the objects, so they are misses afterwards).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

_LOOPBACK = "127.0.0.1"
INSTALL_HINT = ("Mooncake Store is not installed: pip install '.[mooncake]' in tierkv's clone (the distribution is tierkv-engine) "
                "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1 librdmacm1")


class MooncakeServerError(RuntimeError):
    """The Mooncake binaries could not be found, started or reached."""


def mooncake_importable() -> str | None:
    """None when ``mooncake.store`` imports; else why not (with the install hint)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"{INSTALL_HINT} ({exc})"
    return None


def find_binary(name: str) -> str | None:
    """A Mooncake binary: inside the installed ``mooncake`` package, beside this interpreter, or on PATH."""
    try:
        import mooncake
        inside = Path(mooncake.__file__).parent / name
        if inside.exists():
            return str(inside)
    except ImportError:
        pass
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def free_port() -> int:
    """A TCP port on the loopback that is free now (a server started next may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


def _stop(process: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """Stop one process this module started, by its PID (TERM, then KILL)."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


class MooncakeCluster:
    """A master and one storage node holding ``pool_size`` bytes; a context manager."""

    def __init__(self, pool_size: int = 256 << 20, client_ttl_s: int = 2) -> None:
        reason = mooncake_importable()
        master, node = find_binary("mooncake_master"), find_binary("mooncake_client")
        if reason or master is None or node is None:
            raise MooncakeServerError(reason or INSTALL_HINT)
        self.master_binary, self.node_binary = master, node
        self.pool_size = pool_size
        self.client_ttl_s = client_ttl_s
        self.rpc_port = self.metadata_port = self.metrics_port = self.node_port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def master_address(self) -> str:
        return f"{_LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{_LOOPBACK}:{self.metadata_port}/metadata"

    def tier_options(self, **extra: object) -> dict[str, object]:
        """Options of a ``mooncake`` tier that joins this cluster from this machine (mounting nothing)."""
        return {"master_address": self.master_address, "metadata_server": self.metadata_server,
                "local_hostname": _LOOPBACK, "protocol": "tcp", "segment_size": 0, **extra}

    def _log(self, name: str) -> Path:
        assert self._workdir is not None
        return Path(self._workdir.name) / f"{name}.log"

    def _tail(self, name: str) -> str:
        path = self._log(name)
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"

    def start(self, timeout_s: float = 30.0) -> MooncakeCluster:
        """Start the master, then the storage node; wait until the node has mounted its segment."""
        self._workdir = tempfile.TemporaryDirectory(prefix="tierkv-mooncake-")
        self.rpc_port, self.metadata_port, self.metrics_port, self.node_port = (free_port() for _ in range(4))
        try:
            self.start_master(timeout_s)
            self._start_node(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self, timeout_s: float = 30.0) -> None:
        """(Re)start the master on this cluster's ports; returns once both of its ports answer."""
        log = self._log("master").open("ab")
        self.master = subprocess.Popen(
            [self.master_binary, f"--rpc_address={_LOOPBACK}", f"--rpc_port={self.rpc_port}",
             "--enable_http_metadata_server=true", f"--http_metadata_server_host={_LOOPBACK}",
             f"--http_metadata_server_port={self.metadata_port}", f"--metrics_host={_LOOPBACK}",
             f"--metrics_port={self.metrics_port}", f"--client_ttl={self.client_ttl_s}", "--logtostderr"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir.name if self._workdir else None)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.master.poll() is not None:
                break
            if _answers(self.rpc_port) and _answers(self.metadata_port):
                return
            time.sleep(0.05)
        raise MooncakeServerError(f"mooncake_master did not start; its log ends with:\n{self._tail('master')}")

    def _start_node(self, timeout_s: float) -> None:
        log = self._log("node").open("ab")
        self.node = subprocess.Popen(
            [self.node_binary, f"--host={_LOOPBACK}", f"--port={self.node_port}",
             f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata_server}",
             f"--global_segment_size={self.pool_size}", "--local_buffer_size=16MB", "--protocol=tcp",
             "--logtostderr"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir.name if self._workdir else None)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.node.poll() is None:
            if "Starting real client service" in self._tail("node") or _answers(self.node_port):
                return
            time.sleep(0.05)
        raise MooncakeServerError(f"mooncake_client (storage node) did not start; its log ends with:\n"
                                  f"{self._tail('node')}")

    def stop_master(self) -> None:
        """Stop the master by its PID (an outage); the storage node keeps running."""
        _stop(self.master)
        self.master = None

    def stop(self) -> None:
        """Stop the storage node and the master by PID, remove the logs. Idempotent."""
        _stop(self.node)
        self.node = None
        self.stop_master()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
