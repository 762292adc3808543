"""Host-side parent of ``bwrap``: a child subreaper that outlives the whole sandbox tree.

Not imported by the host: :mod:`prefect_tinker.recipes.sandbox.isolation` runs this source with
``python -I -S -c`` and the arguments ``UID HOST_PID BWRAP [BWRAP ARGS...]`` (``UID`` is ``-`` to keep
the current uid; ``HOST_PID`` is the pid of the process that started it).

Why: ``bwrap`` exits as soon as its PID-1 process reports the program's status, before reaping
that PID-1 process, which is then reparented to the nearest subreaper (normally the host's init).
Where the host's PID 1 does not reap (a Python worker as a container's PID 1), each execution
would leave a zombie.  As ``PR_SET_CHILD_SUBREAPER`` this process receives the orphan, reaps every
descendant, and exits with bwrap's status.  On SIGTERM it SIGKILLs bwrap (whose
``--die-with-parent`` PID-1 child then takes the PID namespace down) and keeps reaping.
When the host process dies (``PR_SET_PDEATHSIG``, as SIGUSR1) it SIGKILLs its whole process group
(the host starts it as a session and group leader): bwrap and bwrap's inner process while that one is
still setting up -- before it has set its own ``--die-with-parent`` signal and left the group, it
would otherwise wait forever for the dead outer bwrap.  So a crashed host leaves no sandbox running.
It drops to ``UID`` (when started as root) only in the child that execs bwrap.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def main():
    uid, host_pid, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    signal.signal(signal.SIGUSR1, lambda signum, frame: os.killpg(0, signal.SIGKILL))  # the host died
    if (
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0
        or libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0) != 0
    ):
        os.write(2, b"sandbox reaper: prctl failed\n")
        os._exit(126)
    if os.getppid() != host_pid:  # the host died before PR_SET_PDEATHSIG took effect
        os._exit(1)
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
