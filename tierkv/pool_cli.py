"""``tierkv pool``: the operator's handle on a node pool (the ``shm`` tier) while engines use it.

``status`` says what the pool holds per model and per scope (one scope per model identity x
adapter x tenant x media: a tenant's salt is hashed into it, never stored), how full it is,
who is attached, what leases retain, and its reads, evictions and drops; ``drop`` removes one model's chunks, some
scopes' or all, safely beside live engines (a chunk being read is freed after its last reader;
engines with KV events announce the removal). Both join the pool as any process does, with the
geometry its header records, so they need no engine config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tierkv.backend import registry
from tierkv.backend.options import format_size
from tierkv.errors import TierKVError


@contextmanager
def _attached(path: str | None) -> Iterator[Any]:
    attach = getattr(registry.load("shm"), "attach", None)
    if attach is None:
        raise TierKVError("the installed 'shm' backend cannot join an existing pool (no attach)")
    tier = attach(path, name="tierkv-pool")
    try:
        yield tier
    finally:
        asyncio.run(tier.close())


def pool_status(tier: Any) -> dict[str, Any]:
    """The status ``tierkv pool status`` prints, as a dict (its ``--json``)."""
    stats = tier.stats()
    names = tier.scope_names()
    scopes = [{"scope": scope, "model": names.get(scope), **usage} for scope, usage in sorted(tier.scope_usage().items())]
    models: dict[str, dict[str, int]] = {}
    for row in scopes:
        model = models.setdefault(row["model"] or "(unnamed)", {"scopes": 0, "chunks": 0, "bytes": 0})
        model["scopes"] += 1
        model["chunks"] += row["chunks"]
        model["bytes"] += row["bytes"]
    others = tier.attached_processes()
    return {"path": tier.path, "capacity": tier.capacity, "used_bytes": tier.used_bytes,
            "chunks": stats.get("pool_chunks", 0), "attached_pids": others,
            "reads": stats.get("pool_reads", 0), "evictions": stats.get("pool_evictions", 0),
            "evicted_bytes": stats.get("pool_evicted_bytes", 0), "drops": stats.get("pool_drops", 0),
            "recoveries": stats.get("recoveries", 0), "reaped_processes": stats.get("reaped_processes", 0),
            "retained_bytes": stats.get("pool_retained_bytes", 0),
            "retained_evictions": stats.get("pool_retained_evictions", 0),
            "models": models, "scopes": scopes}


def _print_status(status: dict[str, Any]) -> None:
    capacity, used = status["capacity"], status["used_bytes"]
    print(f"pool {status['path']}: {format_size(used)} of {format_size(capacity)} used "
          f"({100 * used / capacity:.0f}%), {status['chunks']} chunks")
    pids = status["attached_pids"]
    print(f"attached: {len(pids)} process(es)" + (f" (pids {', '.join(map(str, pids))})" if pids else ""))
    print(f"reads {status['reads']}, evictions {status['evictions']} ({format_size(status['evicted_bytes'])}), "
          f"drops {status['drops']}, recoveries {status['recoveries']}, reaped processes {status['reaped_processes']}")
    print(f"retained (leases from hints): {format_size(status['retained_bytes'])}, retained chunks evicted under "
          f"pressure {status['retained_evictions']}")
    if not status["scopes"]:
        print("it holds nothing")
        return
    width = max(len(name) for name in status["models"])
    print(f"\n{'MODEL':<{width}}  SCOPES  CHUNKS  BYTES")
    for name, row in sorted(status["models"].items()):
        print(f"{name:<{width}}  {row['scopes']:>6}  {row['chunks']:>6}  {format_size(row['bytes'])}")
    print(f"\n{'SCOPE':<16}  {'MODEL':<{width}}  CHUNKS  BYTES   (a scope: one adapter, tenant or media of a model)")
    for row in status["scopes"]:
        print(f"{row['scope']:<16}  {row['model'] or '(unnamed)':<{width}}  {row['chunks']:>6}  "
              f"{format_size(row['bytes'])}")


def _cmd_status(args: argparse.Namespace) -> int:
    with _attached(args.path) as tier:
        status = pool_status(tier)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status)
    return 0


def _cmd_drop(args: argparse.Namespace) -> int:
    with _attached(args.path) as tier:
        if args.all:
            scopes = None
        elif args.model is not None:
            names = tier.scope_names()
            usage = tier.scope_usage()
            scopes = [scope for scope in usage if names.get(scope) == args.model]
            if not scopes:
                known = sorted({name for scope, name in names.items() if scope in usage})
                raise TierKVError(f"the pool holds no chunk of a model named {args.model!r}; it holds chunks of "
                                  f"{known or 'no named model'} (`tierkv pool status` lists them)")
        else:
            scopes = list(args.scope)
        chunks, nbytes = tier.drop_scopes(scopes)
    what = "every chunk" if scopes is None else (f"model {args.model!r}" if args.model else f"scopes {scopes}")
    print(f"dropped {chunks} chunks ({format_size(nbytes)}) of {what}")
    return 0


def add_pool_command(commands: Any) -> None:
    """``tierkv pool status|drop`` on the subcommands of the ``tierkv`` parser."""
    pool = commands.add_parser("pool", help="a node pool (shm tier) while engines use it: what it holds, drop "
                                            "a model's or a tenant's chunks")
    actions = pool.add_subparsers(dest="action", required=True)
    status = actions.add_parser("status", help="usage per model and scope, attached processes, reads, evictions")
    status.add_argument("--path", default=None, help="the pool file (default /dev/shm/tierkv-<uid>.pool)")
    status.add_argument("--json", action="store_true", help="as JSON")
    status.set_defaults(func=_cmd_status)
    drop = actions.add_parser("drop", help="drop chunks from the pool (safe beside live engines)")
    drop.add_argument("--path", default=None, help="the pool file (default /dev/shm/tierkv-<uid>.pool)")
    which = drop.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="every chunk of this model (its name as the engines give it)")
    which.add_argument("--scope", action="append", help="every chunk of this scope (16 hex digits, from status); "
                                                        "repeat for more")
    which.add_argument("--all", action="store_true", help="every chunk")
    drop.set_defaults(func=_cmd_drop)
