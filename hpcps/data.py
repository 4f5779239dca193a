"""``python -m hpcps.data``: runs :mod:`hpcps.io.data` (prepare and inspect datasets)."""
from hpcps.io.data.sources import main

if __name__ == "__main__":
    raise SystemExit(main())
