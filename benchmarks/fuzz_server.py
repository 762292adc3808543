"""The long run of the server fuzzing of ``tests/test_fuzz_server.py``: the same properties (no 500,
no hang, no crash of the compute thread, every refusal a one-line 4xx) with many more examples per
operation and per request model than the suite's three.

    python benchmarks/fuzz_server.py --examples 200      # ~N x 50 requests; minutes to an hour
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=200, help="hypothesis examples per operation / model")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FUZZ_EXAMPLES": str(args.examples)}
    raise SystemExit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                                      str(repo / "tests" / "test_fuzz_server.py")], cwd=repo, env=env))
