"""Print what an hpcps checkpoint holds.

Usage::

    python -m hpcps.inspect runs/mnist/ckpt.h5          # human-readable summary
    python -m hpcps.inspect runs/mnist/ckpt.h5 --json   # the same facts as one JSON object

The whole file is read and verified (checksums, layout version), so this is also the way to
check that a checkpoint is intact before resuming from it. A bad file prints
``hpcps.inspect: error: <reason>`` on stderr and exits with code 4 (``CheckpointError``).

Run it with ``-m``: run as ``python hpcps/inspect.py`` this file would shadow the standard
library's ``inspect`` module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hpcps.checkpoint import describe, summarize
from hpcps.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0, or CheckpointError.exit_code)."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.inspect",
        description=(
            "Summarize an hpcps checkpoint (HDF5): format and layout version, step, when and by "
            "which hpcps it was written, layer sizes, the shape and min/max/mean/std of every "
            "parameter and optimizer-state array, the run's config, the dataset identity and the "
            "metrics. The whole file is read and its checksums verified."
        ),
        epilog=f"Exit status: 0 if the checkpoint is intact, {CheckpointError.exit_code} if it is "
        "missing, truncated, corrupt or not an hpcps checkpoint.",
    )
    parser.add_argument("path", metavar="PATH", help="checkpoint file written by hpcps")
    parser.add_argument("--json", action="store_true",
                        help="print the facts as one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        if args.json:
            text = json.dumps(summarize(args.path), indent=2)
        else:
            text = describe(args.path)
    except CheckpointError as exc:
        print(f"{parser.prog.split()[-1]}: error: {exc}", file=sys.stderr)
        return CheckpointError.exit_code
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `... | head`: the reader left; not an error of the checkpoint
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
