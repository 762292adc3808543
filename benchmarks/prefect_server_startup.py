"""Start-up cost of the Prefect API that ``prefect-tinker run`` reports to, per mode.

    python benchmarks/prefect_server_startup.py               # 3 repeats
    python benchmarks/prefect_server_startup.py --repeats 5

Each repeat, in a fresh temporary state folder (``PREFECT_API_URL`` removed from this process):

- **temporary**: entering ``temporary_prefect_api()`` (``PREFECT_TINKER_UI=off``: the API without UI
  that every run starts and stops);
- **first start**: ``ensure_prefect_server()`` on an empty folder (the persistent server with its UI:
  database created and migrated, the UI's files copied);
- **reuse**: ``ensure_prefect_server()`` again (the record and a health check: what every later run pays);
- **restart**: ``ensure_prefect_server()`` after ``stop_prefect_server()`` (the database exists; same port).

Seconds from the call until the API answered ``/api/health``. The servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.pop("PREFECT_API_URL", None)
    from prefect_tinker.cli.prefect_api import temporary_prefect_api
    from prefect_tinker.cli.prefect_server import ensure_prefect_server, stop_prefect_server

    for _ in range(args.repeats):
        folder = tempfile.mkdtemp(prefix="prefect-server-startup-")
        try:
            t = time.monotonic()
            with temporary_prefect_api(log_dir=folder):
                temporary = time.monotonic() - t
            t = time.monotonic()
            first = ensure_prefect_server(folder)
            first_s = time.monotonic() - t
            t = time.monotonic()
            again = ensure_prefect_server(folder)
            reuse_s = time.monotonic() - t
            assert again["pid"] == first["pid"] and not again["started"]
            stop_prefect_server(folder)
            t = time.monotonic()
            restarted = ensure_prefect_server(folder)
            restart_s = time.monotonic() - t
            assert restarted["port"] == first["port"]
        finally:
            stop_prefect_server(folder)
            shutil.rmtree(folder, ignore_errors=True)
        print(
            f"temporary API {temporary:.1f} s | persistent first start {first_s:.1f} s | "
            f"reuse {reuse_s * 1000:.0f} ms | restart on its database {restart_s:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
