"""The backend contract and what wraps or finds backends.

``tierkv.backend`` is the import a backend author needs: ``StorageBackend``,
``BlobBackend``, the capability Protocols and the destination helpers are re-exported
from ``tierkv.backend.contract``, and ``Option`` (the option type every tier declares)
from ``tierkv.backend.options``. Beside them: the entry-point registry, codecs and the
coded wrapper that applies them.
"""

from tierkv.backend.contract import (
    FULL_DISK_ERRNOS,
    BlobBackend,
    ChunkHold,
    DemoteSink,
    InPlaceTier,
    NamesVictims,
    ReclaimsHeldMemory,
    StorageBackend,
    SupportsDemotion,
    SupportsPressure,
    check_batch,
    check_destinations,
    fill_destination,
    fits_destination,
    full_disk_error,
)
from tierkv.backend.options import Option

__all__ = [
    "BlobBackend",
    "ChunkHold",
    "DemoteSink",
    "FULL_DISK_ERRNOS",
    "InPlaceTier",
    "NamesVictims",
    "Option",
    "ReclaimsHeldMemory",
    "StorageBackend",
    "SupportsDemotion",
    "SupportsPressure",
    "check_batch",
    "check_destinations",
    "fill_destination",
    "fits_destination",
    "full_disk_error",
]
