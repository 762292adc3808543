"""The first program inside the sandbox: set the resource limits, then run the user's program.

Not imported by the host: :mod:`prefect_tinker.recipes.sandbox.isolation` passes this source to the
sandbox's interpreter (``python -E -s -B -u -c``) with the arguments
``REPORT_FD LIFELINE_FD LIMITS MAIN.py [ARGS...]``, where ``LIMITS`` is ``NAME=SOFT:HARD,...`` (``CPU=10:11,...``
for ``resource.RLIMIT_CPU`` and so on).

The limits are set here, inside the new user namespace, rather than on the host before ``bwrap``
starts: ``RLIMIT_NPROC`` set before the namespace exists would also cap the new namespace's parent
count (every process of the invoking user), while set here it counts only the sandbox's processes
(Linux ``ucounts``, kernel >= 5.14).  Soft and hard values are both lowered, so the program cannot
raise them again.  The program then runs in this interpreter as ``__main__`` (``runpy``), which saves
a second interpreter start.

``REPORT_FD`` is a pipe to the host: a launch failure is written there (exit status 125); it is
closed before the program starts, so the program cannot pose as the launcher.

``LIFELINE_FD`` is the read end of a pipe whose only write end the host holds: a thread started
first thing waits on it and ends this process (and with it bwrap's PID 1 and the whole PID
namespace) when it reads end-of-file, i.e. when the host is gone.  This covers the start-up window
in which the host dies before bwrap's inner process has set its ``--die-with-parent`` signal: that
process survives, but the program it launches finds the lifeline cut and exits at once.
Standard library only.
"""

import os
import resource
import sys
import threading

LAUNCHER_FAILED = 125


def _watch_lifeline(fd):
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    os._exit(137)  # the host is gone (or the program closed the lifeline): end the sandbox


def _launch():
    report_fd = int(sys.argv[1])
    threading.stack_size(65536)  # the watcher needs little stack; keeps it small under RLIMIT_AS
    threading.Thread(target=_watch_lifeline, args=(int(sys.argv[2]),), daemon=True).start()
    threading.stack_size(0)
    try:
        for item in sys.argv[3].split(","):
            name, values = item.split("=")
            soft, hard = (int(v) for v in values.split(":"))
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        if os.getuid() == 0 or os.geteuid() == 0:  # never run the program as root, even a namespaced one
            raise PermissionError("refusing to run the program as uid 0")
        main_path = sys.argv[4]
        if not os.path.isfile(main_path):
            raise FileNotFoundError(main_path)
    except BaseException as exc:  # any failure here is the sandbox's, not the program's
        os.write(report_fd, ("%s: %s\n" % (type(exc).__name__, exc)).encode("utf-8", "replace"))
        os._exit(LAUNCHER_FAILED)
    os.close(report_fd)
    sys.argv = sys.argv[4:]
    sys.path[0] = os.path.dirname(os.path.abspath(main_path))
    return main_path


_main_path = _launch()
del _launch
import runpy  # noqa: E402

runpy.run_path(_main_path, run_name="__main__")
