"""``python -m hpcps.train`` under resource limits, for the tests of data larger than a rank's
memory and of a full disk: an address-space limit of $HPCPS_TEST_AS_MIB MiB (RLIMIT_AS, what
``ulimit -v`` sets), and a limit of $HPCPS_TEST_FSIZE bytes on the files written (RLIMIT_FSIZE,
``ulimit -f``; a write past it fails with EFBIG as one past a full disk fails with ENOSPC), on
the world rank $HPCPS_TEST_FSIZE_RANK only when that is set, from after MPI's start (MPI
creates its shared-memory files at start). Either may be left unset.
``limited_train.py -m MODULE ARGS`` runs another command (``hpcps.evaluate``) so."""
import os
import resource
import runpy
import signal
import sys

if "HPCPS_TEST_AS_MIB" in os.environ:
    limit = int(os.environ["HPCPS_TEST_AS_MIB"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
if "HPCPS_TEST_FSIZE" in os.environ and \
        os.environ.get("HPCPS_TEST_FSIZE_RANK", rank) == rank:
    from mpi4py import MPI  # noqa: F401  (MPI starts here, as hpcps would start it)
    size = int(os.environ["HPCPS_TEST_FSIZE"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
args = sys.argv[1:]
module = "hpcps.train"
if args[:1] == ["-m"]:
    module, args = args[1], args[2:]
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__")
