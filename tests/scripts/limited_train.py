"""``python -m hpcps.train`` under an address-space limit of $HPCPS_TEST_AS_MIB MiB
(RLIMIT_AS, what ``ulimit -v`` sets), for the tests of data larger than a rank's memory."""
import os
import resource
import runpy
import sys

limit = int(os.environ["HPCPS_TEST_AS_MIB"]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["hpcps.train", *sys.argv[1:]]
runpy.run_module("hpcps.train", run_name="__main__")
