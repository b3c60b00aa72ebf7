"""The ``mooncake`` tier: chunks in a Mooncake store; ``tier`` is the backend, ``arena`` its
registered staging memory, ``options`` the parsing of its addresses.
"""

from tierkv_backends.mooncake.tier import MooncakeBackend

__all__ = ["MooncakeBackend"]
