"""An ``identity_hook`` for the vLLM connector's tests (loaded by name, as a user's would be)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tierkv.chunks.identity import RequestIdentity


def per_priority(request: Any, identity: RequestIdentity) -> RequestIdentity | None:
    """Key requests apart by priority; leave negative priorities uncached."""
    if request.priority < 0:
        return None
    return dataclasses.replace(identity, extra=(*identity.extra, f"priority={request.priority}"))
