"""The ``s3`` tier: one object per chunk in an S3 bucket; ``tier`` is the backend, beside it
its options, the blocking requests, what a reply means and the lookup cache.
"""

from tierkv_backends.s3.tier import S3Backend

__all__ = ["S3Backend"]
