"""Host-side parent of ``bwrap``: a child subreaper that outlives the whole sandbox tree.

Not imported by the host: :mod:`prefect_tinker.recipes.sandbox.core` runs this source with
``python -I -S -c`` and the arguments ``UID BWRAP [BWRAP ARGS...]`` (``UID`` is ``-`` to keep the
current uid).

Why: ``bwrap`` exits as soon as its PID-1 process reports the program's status, before reaping
that PID-1 process, which is then reparented to the nearest subreaper (normally the host's init).
Where the host's PID 1 does not reap (a Python worker as a container's PID 1), each execution
would leave a zombie.  As ``PR_SET_CHILD_SUBREAPER`` this process receives the orphan, reaps every
descendant, and exits with bwrap's status.  On SIGTERM it SIGKILLs bwrap (whose
``--die-with-parent`` PID-1 child then takes the PID namespace down) and keeps reaping.
It drops to ``UID`` (when started as root) only in the child that execs bwrap.
"""

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def main():
    uid, argv = sys.argv[1], sys.argv[2:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        os.write(2, b"sandbox reaper: prctl(PR_SET_CHILD_SUBREAPER) failed\n")
        os._exit(126)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the handler below knows bwrap's pid
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if uid != "-":
                os.setgroups([])
                os.setgid(int(uid))
                os.setuid(int(uid))
            os.execv(argv[0], argv)
        finally:
            os._exit(127)

    def stop(signum, frame):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    code = 1
    while True:
        try:
            died, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if died == pid:
            code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


main()
