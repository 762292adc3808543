"""The first program inside the sandbox: set the resource limits, then run the user's program.

Not imported by the host: :mod:`prefect_tinker.recipes.sandbox.isolation` passes this source to the
sandbox's interpreter (``python -E -s -B -u -c``) with the arguments
``REPORT_FD LIMITS MAIN.py [ARGS...]``, where ``LIMITS`` is ``NAME=SOFT:HARD,...`` (``CPU=10:11,...``
for ``resource.RLIMIT_CPU`` and so on).

The limits are set here, inside the new user namespace, rather than on the host before ``bwrap``
starts: ``RLIMIT_NPROC`` set before the namespace exists would also cap the new namespace's parent
count (every process of the invoking user), while set here it counts only the sandbox's processes
(Linux ``ucounts``, kernel >= 5.14).  Soft and hard values are both lowered, so the program cannot
raise them again.  The program then runs in this interpreter as ``__main__`` (``runpy``), which saves
a second interpreter start.

``REPORT_FD`` is a pipe to the host: a launch failure is written there (exit status 125); it is
closed before the program starts, so the program cannot pose as the launcher.
Standard library only.
"""

import os
import resource
import sys

LAUNCHER_FAILED = 125


def _launch():
    report_fd = int(sys.argv[1])
    try:
        for item in sys.argv[2].split(","):
            name, values = item.split("=")
            soft, hard = (int(v) for v in values.split(":"))
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        if os.getuid() == 0 or os.geteuid() == 0:  # never run the program as root, even a namespaced one
            raise PermissionError("refusing to run the program as uid 0")
        main_path = sys.argv[3]
        if not os.path.isfile(main_path):
            raise FileNotFoundError(main_path)
    except BaseException as exc:  # any failure here is the sandbox's, not the program's
        os.write(report_fd, ("%s: %s\n" % (type(exc).__name__, exc)).encode("utf-8", "replace"))
        os._exit(LAUNCHER_FAILED)
    os.close(report_fd)
    sys.argv = sys.argv[3:]
    sys.path[0] = os.path.dirname(os.path.abspath(main_path))
    return main_path


_main_path = _launch()
del _launch
import runpy  # noqa: E402

runpy.run_path(_main_path, run_name="__main__")
