"""``python -m tierkv.ops build|status``: build the extension or say what is loaded."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tierkv.ops.extension import _state, _try_load_prebuilt, build_extension, extension_status


def _main(argv: Sequence[str]) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tierkv.ops", description="build or inspect the tierkv extension")
    parser.add_argument("command", choices=("build", "status"))
    parser.add_argument("--build-dir", default=None, help="cache directory (default $TORCH_EXTENSIONS_DIR)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build":
        build_extension(args.build_dir, verbose=args.verbose)
    elif args.build_dir:
        _try_load_prebuilt(Path(args.build_dir))
    print(json.dumps(extension_status(), indent=2))
    return 0 if args.command == "status" or _state["loaded"] else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
