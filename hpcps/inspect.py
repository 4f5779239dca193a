"""Print what a checkpoint holds: ``python -m hpcps.inspect PATH [--json]``.

Shapes and value statistics of every layer, the optimizer and its state, the step, the config,
the dataset identity and the metrics. Exit code 4 (with one line on stderr) for a file that is
missing, truncated, corrupt or not an hpcps checkpoint.
"""
from __future__ import annotations

import argparse
import json
import sys

from hpcps import checkpoint
from hpcps.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.inspect",
        description="Print what an hpcps HDF5 checkpoint holds.")
    parser.add_argument("path", help="checkpoint file (e.g. runs/NAME/checkpoint.h5)")
    parser.add_argument("--json", action="store_true",
                        help="print the same facts as one JSON object")
    args = parser.parse_args(argv)
    try:
        if args.json:
            print(json.dumps(checkpoint.summarize(args.path), indent=2))
        else:
            print(checkpoint.describe(args.path))
    except CheckpointError as exc:
        print(f"hpcps.inspect: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
