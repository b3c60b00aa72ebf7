"""Session-wide local S3 server for the tests (SeaweedFS, MinIO, or TIERKV_S3_ENDPOINT).

Loaded from conftest.py through ``pytest_plugins``. The server is started once per test
session with its data in a temporary directory and stopped by its PID at the end.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tierkv.testing.s3server import S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A running S3 server on 127.0.0.1 shared by every test of the session."""
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server) -> str:
    """A bucket created once for the session; tests separate their data by prefix."""
    name = f"tierkv-test-{uuid.uuid4().hex[:8]}"
    s3_server.boto3_client().create_bucket(Bucket=name)
    return name


def s3_tier_options(server: S3Server, bucket: str, prefix: str, **extra: Any) -> dict[str, Any]:
    """Options for an ``s3`` tier on ``server`` with short timeouts, so faults show up fast."""
    return {"bucket": bucket, "prefix": prefix, **server.client_options(), "connect_timeout_s": 0.5,
            "read_timeout_s": 2.0, "timeout_s": 3.0, "retries": 2, "backoff_base_s": 0.01,
            "backoff_max_s": 0.05, "probe_interval_s": 0.1, **extra}


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A TCP endpoint that accepts connections and never answers (a hung object store)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()
