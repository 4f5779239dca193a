"""``python -m hpcps.tools.report``: the report's command (:func:`main`)."""
from hpcps.tools.report import main

if __name__ == "__main__":
    raise SystemExit(main())
