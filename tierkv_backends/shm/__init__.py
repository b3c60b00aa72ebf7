"""The ``shm`` tier: one host cache per node, a pool file every process maps; ``tier`` is the
backend over ``pool`` (the state machine: lock, entries, holds, reaping, recovery), ``index``
(hash table and free extents), ``file`` (open, check, map) and ``layout`` (the file's format).
"""

from tierkv_backends.shm.tier import PoolHold, SharedMemoryBackend

__all__ = ["PoolHold", "SharedMemoryBackend"]
