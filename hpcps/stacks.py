"""``python -m hpcps.stacks``: runs :mod:`hpcps.runtime.stacks`."""
from hpcps.runtime.stacks import main

if __name__ == "__main__":
    raise SystemExit(main())
