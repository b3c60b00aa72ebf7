"""LMCache's multiprocess server, the baseline the replica benchmarks run tierkv beside.

One ``lmcache server`` per node (LMCache 0.5.6), every replica's ``LMCacheMPConnector``
connected to it: LMCache's answer to one cache per node, as the ``shm`` pool is tierkv's. Its CPU
path (the engine-driven transfer: the vLLM worker copies its blocks and sends them) imports
none of LMCache's CUDA dependencies, so it is installed without them
(``pip install --no-deps``, as ``tox -e bench-replicas`` does).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tierkv.testing.processes import start_group, stop_group

LMCACHE_SPEC = "lmcache==0.5.6"
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
"""LMCache's servers and connectors report usage to a remote host unless told not to."""


def start_lmcache_server(port: int, http_port: int, log: Path, chunk_tokens: int = 0) -> subprocess.Popen[bytes]:
    """LMCache's server (``lmcache server``, multiprocess mode) with the pool's 1 GiB, the
    replicas' chunk size (``chunk_tokens``; 0: ``serving.CHUNK``), LRU, and the engine-driven
    transfer its CPU path needs; ready once its health check answers."""
    from serving import CHUNK

    chunk_tokens = chunk_tokens or CHUNK

    script = Path(sys.executable).parent / "lmcache"
    if not script.exists():
        raise SystemExit(f"lmcache-mp: LMCache is not installed in this environment: pip install --no-deps "
                         f"{LMCACHE_SPEC} sortedcontainers opentelemetry-exporter-prometheus==0.66b2 "
                         "(its CUDA dependencies are not needed on its CPU path)")
    args = [str(script), "server", "--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(chunk_tokens),
            "--l1-size-gb", "1", "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
            "--max-workers", "2", "--http-host", "127.0.0.1", "--http-port", str(http_port)]
    with open(log, "wb") as handle:
        process = start_group(args, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **LMCACHE_ENV})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthcheck", timeout=2):
                return process
        except OSError:
            time.sleep(0.5)
    stop_group(process)
    raise RuntimeError(f"lmcache server did not answer within 120 s:\n{log.read_text()[-4000:]}")
