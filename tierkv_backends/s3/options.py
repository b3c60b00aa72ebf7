"""The ``s3`` tier's YAML options: the one place its settings and their defaults are written.

``tierkv_backends.s3.S3Backend`` takes exactly these keyword arguments and fills what
is not given from here (and checks what is, as the YAML loader does), so a default cannot
drift between the config documentation and the constructor.
"""

from __future__ import annotations

from tierkv.backend.options import Option
from tierkv_backends.s3.requests import bucket_name, key_prefix

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's minimum multipart part size (all parts but the last)

S3_OPTIONS: dict[str, Option] = {
    "bucket": Option(bucket_name, required=True, doc="bucket holding the chunks"),
    "prefix": Option(key_prefix, "tierkv", doc="object-name prefix inside the bucket"),
    "endpoint_url": Option("str", None, doc="S3 endpoint, e.g. http://127.0.0.1:9000 (AWS when unset)"),
    "region": Option("str", None, doc="region name (us-east-1 when unset)"),
    # credentials: leave them out for boto3's chain (AWS_* variables, ~/.aws profiles, instance roles), or
    # name an environment variable holding each ({env: NAME}); written out, a serving engine may log them
    "access_key_id": Option("str", None, secret=True, doc="access key, or {env: NAME} (else the boto3 chain)"),
    "secret_access_key": Option("str", None, secret=True, doc="secret key, or {env: NAME} (with access_key_id)"),
    "session_token": Option("str", None, secret=True, doc="session token for temporary credentials, or {env: NAME}"),
    "profile": Option("str", None, doc="a profile of the shared credentials and config files (~/.aws), as "
                                       "AWS_PROFILE picks one"),
    "addressing_style": Option("str", "path", choices=("path", "virtual", "auto"),
                               doc="path for MinIO/SeaweedFS, virtual for AWS"),
    "max_concurrency": Option("int", 16, minimum=1, doc="requests in flight at once, for reads and for writes each "
                                                         "(a read the store stalls never holds a write's slot)"),
    "connect_timeout_s": Option("float", 2.0, minimum=0.01, doc="seconds to open a connection (capped by "
                                                                 "timeout_s)"),
    "read_timeout_s": Option("float", 10.0, minimum=0.01, doc="seconds a socket waits for the next bytes "
                                                           "(capped by timeout_s)"),
    "timeout_s": Option("float", 30.0, minimum=0.01, doc="deadline of one batched operation, retries included; "
                                                         "a request still running then gives its slot back, and "
                                                         "its socket waits no longer than this"),
    "retries": Option("int", 3, minimum=0, doc="retries of a throttled or transient request"),
    "backoff_base_s": Option("float", 0.05, minimum=0.0, doc="first retry's delay; doubled per retry, jittered"),
    "backoff_max_s": Option("float", 1.0, minimum=0.0, doc="longest delay between retries"),
    "multipart_threshold": Option("size", 64 * MiB, doc="puts this large or larger use multipart upload"),
    "part_size": Option("size", 64 * MiB, minimum=MIN_PART, doc="multipart part and ranged-GET size"),
    "min_range": Option("size", None, minimum=64 << 10,
                        doc="split each object of a batch smaller than max_concurrency into ranges of at least "
                            "this size, fetched at once (for stores whose one connection is slower than several, "
                            "e.g. AWS S3: 8MiB); default: off (on loopback one GET is faster)"),
    "lookup_cache": Option("int", 100_000, minimum=0, doc="chunks whose existence is remembered, so lookups "
                                                          "need no HEAD for them (0: every lookup asks the store)"),
    "lookup_cache_ttl_s": Option("float", 300.0, minimum=0.0, doc="how long a chunk seen to exist is believed to "
                                                                  "(a deleted one is a miss on its read)"),
    "lookup_miss_ttl_s": Option("float", 2.0, minimum=0.0, doc="how long a chunk found missing is believed "
                                                               "missing (another replica may store it)"),
    "create_bucket": Option("bool", False, doc="create the bucket when it does not exist"),
    "check_on_start": Option("bool", True, doc="check endpoint, credentials and bucket when the tier is built"),
    "failure_threshold": Option("int", 3, minimum=1, doc="failed batches in a row that mark the tier unhealthy"),
    "probe_interval_s": Option("float", 2.0, minimum=0.01, doc="how often an unhealthy tier is probed"),
}
