"""``python -m hpcps.scaling``: runs :mod:`hpcps.tools.scaling`."""
from hpcps.tools.scaling import main

if __name__ == "__main__":
    raise SystemExit(main())
