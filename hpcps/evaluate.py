"""``python -m hpcps.evaluate``: runs :mod:`hpcps.tools.evaluate`."""
from hpcps.tools.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
