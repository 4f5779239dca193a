"""``python -m hpcps.tools.scaling``: the scaling model's command (:mod:`.cli`)."""
from hpcps.tools.scaling.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
