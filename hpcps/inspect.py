"""``python -m hpcps.inspect``: runs :mod:`hpcps.tools.inspect`."""
from hpcps.tools.inspect import main

if __name__ == "__main__":
    raise SystemExit(main())
