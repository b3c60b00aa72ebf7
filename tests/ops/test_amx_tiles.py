"""The AMX tile-state request (tierkv.ops.amx_tiles): on a CPU with AMX a process holds the
permission after the request and not before; elsewhere nothing is asked and the answer says so.

Each check runs in a fresh interpreter: the permission is per process and cannot be handed
back, so this pytest process (which may have run oneDNN's bf16 matmuls, which ask too) proves
nothing. The vLLM side (every worker asks before its first load) is checked in
tests/integrations/vllm_v1/test_vllm_v1.py through the connector's stats.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tierkv.ops.amx_tiles import AMXTiles, cpu_has_amx

PROBE = """
import json
from tierkv.ops import amx_tiles
before = amx_tiles.amx_tiles_permitted()
state = amx_tiles.request_amx_tiles()
print(json.dumps({"before": before, "state": int(state), "after": amx_tiles.amx_tiles_permitted()}))
"""


def fresh_process_request() -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def cpuinfo_says_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as handle:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in handle)
    except OSError:
        return False


def test_the_cpu_probe_agrees_with_the_kernels_flags() -> None:
    assert cpu_has_amx() == cpuinfo_says_amx()


def test_a_fresh_process_holds_the_tile_state_only_after_asking_where_the_cpu_has_amx() -> None:
    found = fresh_process_request()
    if cpu_has_amx():
        assert found == {"before": False, "state": int(AMXTiles.GRANTED), "after": True}, found
    else:
        assert found == {"before": False, "state": int(AMXTiles.NOT_ON_THIS_CPU), "after": False}, found
