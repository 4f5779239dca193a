"""``python -m hpcps.train`` under an address-space limit of $HPCPS_TEST_AS_MIB MiB
(RLIMIT_AS, what ``ulimit -v`` sets), for the tests of data larger than a rank's memory;
``limited_train.py -m MODULE ARGS`` runs another command (``hpcps.evaluate``) so."""
import os
import resource
import runpy
import sys

limit = int(os.environ["HPCPS_TEST_AS_MIB"]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
args = sys.argv[1:]
module = "hpcps.train"
if args[:1] == ["-m"]:
    module, args = args[1], args[2:]
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__")
