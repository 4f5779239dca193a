"""``python -m hpcps.keeper``: runs :mod:`hpcps.runtime.keeper`."""
import os

from hpcps.runtime.keeper import main

if __name__ == "__main__":
    os._exit(main())
