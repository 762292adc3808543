"""The first program inside the sandbox: set the resource limits, then exec the user's program.

This file is not imported by the host. :mod:`prefect_tinker.recipes.sandbox.core` reads its source
and passes it to the sandbox's interpreter with ``-c``, with one JSON argument::

    {"rlimits": [["RLIMIT_CPU", soft, hard], ...], "report_fd": 5, "argv": ["/usr/bin/python3", ..., "main.py"]}

``report_fd`` is a pipe to the host: a launch failure is written there (and the launcher exits
125); on success the fd is closed by ``execv`` (close-on-exec), so the program never holds it and
cannot pose as the launcher.

The limits are set here, inside the new user namespace, rather than on the host before ``bwrap``
starts: ``RLIMIT_NPROC`` set before the namespace exists would also cap the new namespace's parent
count (every process of the invoking user), while set here it counts only the sandbox's processes
(Linux ``ucounts``, kernel >= 5.14).  Limits are lowered for soft and hard values alike, so the
program cannot raise them again.  It must stay standard-library only and run on any Python 3.
"""

import json
import os
import resource
import sys


LAUNCHER_FAILED = 125  # exit status of a failed launch (the reason is on report_fd)


def main():
    report_fd = None
    try:
        spec = json.loads(sys.argv[1])
        report_fd = spec["report_fd"]
        os.set_inheritable(report_fd, False)
        for name, soft, hard in spec["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if os.getuid() == 0 or os.geteuid() == 0:  # never run the program as root, even a namespaced one
            raise PermissionError("refusing to run the program as uid 0")
        argv = spec["argv"]
        os.execv(argv[0], argv)
    except BaseException as exc:  # any failure here is the sandbox's, not the program's
        message = ("%s: %s\n" % (type(exc).__name__, exc)).encode("utf-8", "replace")
        try:
            os.write(report_fd if report_fd is not None else 2, message)
        except (OSError, TypeError):
            os.write(2, message)
        os._exit(LAUNCHER_FAILED)


main()
