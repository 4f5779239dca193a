"""``python -m hpcps.data``: runs :mod:`hpcps.io.data` (prepare and inspect datasets)."""
from hpcps.io.data.sources import main
from hpcps.io.hdf5_writes import leave

if __name__ == "__main__":
    raise SystemExit(leave(main()))
