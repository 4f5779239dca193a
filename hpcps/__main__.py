"""``hpcps COMMAND [options]`` (or ``python -m hpcps``): one name for every command.

``hpcps --version``; ``hpcps train ...`` is ``python -m hpcps.train ...`` (under ``mpiexec``),
and so on for each command below. Each command's ``--help`` says what it takes.
"""
from __future__ import annotations

import importlib
import sys

from hpcps import __version__

# command -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "train": ("hpcps.train", "train under MPI: mpiexec -n N hpcps train [options]"),
    "data": ("hpcps.io.data.sources", "prepare a built-in dataset, convert your own, or show "
             "a dataset file"),
    "evaluate": ("hpcps.tools.evaluate", "test a checkpoint on a dataset, or predict"),
    "export": ("hpcps.tools.export", "write a checkpoint as ONNX or as .npz arrays + JSON"),
    "inspect": ("hpcps.tools.inspect", "print what a checkpoint holds"),
    "report": ("hpcps.tools.report", "tables and figures of runs from their metrics"),
    "scaling": ("hpcps.tools.scaling", "predict examples/s of each strategy on a cluster"),
    "keeper": ("hpcps.runtime.keeper", "start a rank so that its death does not end the job"),
    "join": ("hpcps.join", "add ranks to a running job started with --joins: mpiexec -n K "
             "hpcps join RUN_DIR"),
    "stacks": ("hpcps.runtime.stacks", "every rank's stack of a live job"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: hpcps COMMAND [options]   (hpcps {__version__})", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "hpcps COMMAND --help shows a command's options; hpcps --version its version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"hpcps {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"hpcps: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _ = COMMANDS[argv[0]]
    sys.argv = [f"hpcps {argv[0]}", *argv[1:]]
    from hpcps.io.hdf5_writes import leave  # (a write that failed can crash HDF5's exit)
    return leave(importlib.import_module(module).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
