"""Built-in tierkv backends, registered through the same ``tierkv.backends`` entry points
as third-party ones: ``cpu``, ``lmdb``, ``fs``."""
