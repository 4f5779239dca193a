"""``python -m hpcps.report``: runs :mod:`hpcps.tools.report`."""
from hpcps.tools.report import main

if __name__ == "__main__":
    raise SystemExit(main())
