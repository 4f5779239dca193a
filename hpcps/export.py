"""``python -m hpcps.export``: runs :mod:`hpcps.tools.export`."""
from hpcps.tools.export import main

if __name__ == "__main__":
    raise SystemExit(main())
