"""The ``tierkv`` command: what is installed, and a quick look at a configured engine.

A mistake (a missing file, malformed YAML, an unknown backend, a tier that cannot start) is
one line on stderr, ``tierkv: error: ...``, and exit status 1; ``--debug`` shows the
traceback instead."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from tierkv.backend import registry
from tierkv.backend.registry import DISTRIBUTION
from tierkv.errors import TierKVError
from tierkv.pool_cli import add_pool_command


def _cmd_backends(args: argparse.Namespace) -> int:
    """List the backends; each is imported first (``ok`` means it loads; ``--load`` is kept as
    an alias), so a plugin that cannot be imported is BROKEN and the exit status is 1. A
    built-in backend whose optional dependencies are not installed (its extra, such as
    ``mooncake``) is ``not installed`` and says how to install them; it is not an error."""
    table = registry.installed()
    if not table:
        print("no backends installed (entry-point group 'tierkv.backends' is empty)")
        return 1
    width = max(len(name) for name in table)
    broken = 0
    for name in sorted(table):
        for info in table[name]:
            status = "ok"
            try:
                registry.load(info.qualified_name if len(table[name]) > 1 else name)
            except Exception as exc:  # report every broken plugin, keep listing
                if info.distribution == DISTRIBUTION and isinstance(exc.__cause__, ImportError):
                    status = f"not installed: {one_line(exc.__cause__)}"  # a built-in whose extra is not installed
                else:
                    status = f"BROKEN: {one_line(exc)}"
                    broken += 1
            print(f"{name:<{width}}  {info.distribution} {info.version}  {info.target}  {status}")
    return 1 if broken else 0  # usable as a CI check: --load fails when a plugin cannot be imported


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from tierkv import __version__
    from tierkv.chunks.memory import can_pin_memory, cuda_available
    from tierkv.ops import extension_status

    info = {
        "tierkv": __version__,
        "torch": torch.__version__,
        "cuda_available": cuda_available(),
        "pinned_memory": can_pin_memory(),
        "backends": sorted(registry.installed()),
        "kernels": extension_status(),
    }
    print(json.dumps(info, indent=2))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tierkv.engine.blocking import Engine

    with Engine.from_yaml(args.config) as engine:
        report = _strict_json({**engine.stats(), "occupancy": engine.occupancy()})
        print(json.dumps(report, indent=2, default=str, allow_nan=False))
    return 0


def _strict_json(value: object) -> object:
    """``value`` with every non-finite float (an unbounded capacity, a rate of nothing) as None:
    JSON has no Infinity or NaN, and strict parsers reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


def _cmd_pool_size(args: argparse.Namespace) -> int:
    from tierkv.backend.options import format_size, parse_size

    file_size = getattr(registry.load("shm"), "file_size", None)
    if file_size is None:
        raise TierKVError("the installed 'shm' backend cannot size a pool (no file_size)")
    size = file_size(parse_size(args.capacity, "capacity"), args.path, args.max_chunks, args.max_processes,
                             args.holds_per_process)
    print(f"a pool of capacity {format_size(size['capacity'])} is a file of {format_size(size['file_bytes'])} "
          f"({size['file_bytes']} bytes) at {size['path']}:")
    print(f"  chunks        {format_size(size['capacity'])}")
    print(f"  index         {format_size(size['index_bytes'])} ({size['max_chunks']} chunks, max_chunks)")
    print(f"  hold rows     {format_size(size['hold_rows_bytes'])} ({size['max_processes']} processes x "
          f"{size['holds_per_process']} holds: max_processes, holds_per_process)")
    print(f"  journal       {format_size(size['journal_bytes'])} (journal_bytes)")
    print(f"  header        {format_size(size['header_and_alignment_bytes'])} (with the data's 2 MiB alignment)")
    if size["free_bytes"] is None:
        print(f"  its file system: not found ({size['path']}'s directory does not exist yet)")
        return 0
    kind = size["file_system"] or "unknown"
    print(f"  its file system ({kind}) has {format_size(size['free_bytes'])} free: "
          + ("it fits" if size["fits"] else "it does NOT fit"))
    if not size["fits"]:
        print("tierkv: error: the pool does not fit: give a smaller capacity, or grow the file system (mount -o "
              "remount,size=... /dev/shm; a container: --shm-size)", file=sys.stderr)
        return 1
    return 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from tierkv import demo

    demo.add_arguments(parser)


def _cmd_demo(args: argparse.Namespace) -> int:
    from tierkv import demo

    return demo.main(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierkv`` command line with ``argv`` (default: the process's); the exit status."""
    from tierkv import __version__

    parser = argparse.ArgumentParser(prog="tierkv", description=" ".join(__doc__.replace("``", "'").split()))
    parser.add_argument("--version", action="version", version=f"tierkv {__version__} (distribution {DISTRIBUTION})")
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list installed storage backends")
    backends.add_argument("--load", action="store_true", help="(the default now) import each backend first")
    backends.set_defaults(func=_cmd_backends)
    commands.add_parser("info", help="versions, CUDA and pinned-memory availability").set_defaults(func=_cmd_info)
    inspect = commands.add_parser("inspect", help="open a YAML config and print per-tier occupancy")
    inspect.add_argument("config")
    inspect.set_defaults(func=_cmd_inspect)
    pool_size = commands.add_parser("pool-size", help="what an shm pool of a capacity costs in /dev/shm, and "
                                                      "whether it fits")
    pool_size.add_argument("capacity", help="the shm tier's capacity, e.g. 4GiB")
    pool_size.add_argument("--path", default=None, help="the pool file (default /dev/shm/tierkv-<uid>.pool)")
    pool_size.add_argument("--max-chunks", type=int, default=None, help="as the tier's max_chunks")
    pool_size.add_argument("--max-processes", type=int, default=64, help="as the tier's max_processes")
    pool_size.add_argument("--holds-per-process", type=int, default=None,
                           help="as the tier's holds_per_process (default: derived from max_chunks)")
    pool_size.set_defaults(func=_cmd_pool_size)
    add_pool_command(commands)
    demo = commands.add_parser("demo", help="prefix reuse and CacheBlend on a small random-weight Llama (CPU)")
    _add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (one line without)")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (TierKVError, OSError, ValueError) as exc:
        if args.debug:
            raise
        print(f"tierkv: error: {one_line(exc)}", file=sys.stderr)
        return 1


def one_line(exc: BaseException) -> str:
    """An error's message on one line (YAML and backend messages may span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
