"""``python -m hpcps.data prepare mnist|digits`` and ``python -m hpcps.data info PATH``."""

import sys

from hpcps.io.data.sources import main

sys.exit(main())
