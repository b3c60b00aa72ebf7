"""Built-in tierkv backends, registered through the same ``tierkv.backends`` entry points
as third-party ones: ``cpu`` and ``gpu`` (memory tiers), ``lmdb`` and ``fs`` (local disk),
``s3`` (a shared object store, with the ``s3`` extra) and ``mooncake``."""
