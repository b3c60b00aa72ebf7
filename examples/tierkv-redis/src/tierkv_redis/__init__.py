"""tierkv-redis: a Redis (or Valkey) tier for tierkv, and the worked example of a backend package.

Installing this distribution registers the ``redis`` backend through the
``tierkv.backends`` entry-point group (see ``pyproject.toml``); nothing else is needed
for a YAML tier to say ``backend: redis``.
"""

from tierkv_redis.backend import RedisBackend

__version__ = "0.1.0"

__all__ = ["RedisBackend", "__version__"]
