"""hpcps.procfs: one process read from /proc/PID/stat."""
import os
import subprocess
import sys
import time

from hpcps import procfs


def test_this_process_is_running_under_its_parent():
    me = procfs.stat(os.getpid())
    assert me is not None and me.state == "R" and me.ppid == os.getppid() and me.start > 0


def test_a_name_with_parentheses_and_spaces_a_zombie_and_a_gone_process():
    """The command name may hold ")" and spaces (it is read up to the last ")"); a child that
    exited is a zombie until it is waited for, then gone (None)."""
    child = subprocess.Popen([sys.executable, "-c",
                              "open('/proc/self/comm', 'w').write('a) b (c'); "
                              "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (st := procfs.stat(child.pid)) is not None and st.name != "a) b (c":
            assert time.monotonic() < deadline, st
            time.sleep(0.01)
        assert st is not None and st.ppid == os.getpid() and st.state in "RSD", st
        started = st.start
    finally:
        child.stdin.close()
    while (st := procfs.stat(child.pid)) is not None and st.state != "Z":
        assert time.monotonic() < deadline, st
        time.sleep(0.01)
    assert st is not None and st.start == started  # the same process, not yet waited for
    child.wait()
    assert procfs.stat(child.pid) is None
