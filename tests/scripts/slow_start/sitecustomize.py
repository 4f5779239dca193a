"""On PYTHONPATH for a test: a rank started by hpcps.keeper (HPCPS_KEEPER=1 in its
environment) sleeps HPCPS_TEST_SLOW_START seconds before anything else runs, so that a
signal reaches the job while its ranks' Python starts, before hpcps.train's first line."""
import os
import time

if os.environ.get("HPCPS_KEEPER") == "1":
    time.sleep(float(os.environ.get("HPCPS_TEST_SLOW_START", "0")))
