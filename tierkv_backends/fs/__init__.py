"""The ``fs`` tier: one file per chunk in a directory; ``tier`` is the backend, ``files`` the
byte-level I/O helpers.
"""

from tierkv_backends.fs.tier import FileParts, FSBackend, MakeHeader

__all__ = ["FSBackend", "FileParts", "MakeHeader"]
