"""The local server's allocator tuning (``tinker_local.compute.keep_freed_memory``).

A training step frees and re-allocates the same large buffers; with glibc's defaults every
re-allocation page-faults its memory in again.  Each check runs in a fresh interpreter (mallopt
settings are per process) and counts minor page faults per step over repeated
training steps of the ``tiny`` model in a worker thread, like the server's compute thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

PROBE = r"""
import json, resource, sys, tempfile, threading
import numpy as np
from tinker_local.compute import keep_freed_memory
applied = keep_freed_memory()
from tinker_local.datatypes import Datum
from tinker_local.engine import Engine
eng = Engine(tempfile.mkdtemp(), device="cpu", dtype="fp32", num_threads=1)
eng.create_model("m", "tiny", 8, seed=0)
rng = np.random.default_rng(0)
data = [Datum(tokens=rng.integers(3, 500, 128).tolist(),
              inputs={"target_tokens": rng.integers(3, 500, 128), "weights": np.ones(128, np.float32)})
        for _ in range(8)]
out = {"losses": []}
def step():
    out["losses"].append(eng.forward_backward("m", data, "cross_entropy", None).metrics["loss:sum"])
    eng.optim_step("m", learning_rate=1e-3)
def work():  # in a worker thread, like the server's compute thread
    for _ in range(3):
        step()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    out["faults_per_step"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 5
t = threading.Thread(target=work); t.start(); t.join()
print(json.dumps({"applied": applied, **out}))
"""


def _probe(**env: str) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_training_steps_reuse_freed_memory_without_page_faults():
    default = _probe(TINKER_LOCAL_MALLOC="default")
    tuned = _probe(TINKER_LOCAL_MALLOC="")
    assert default["applied"] is False and tuned["applied"] is True
    assert tuned["losses"] == default["losses"]  # the allocator changes no number
    # glibc defaults: every step maps its activations in again (thousands of faults per step);
    # tuned, a step reuses the freed memory of the previous one
    assert default["faults_per_step"] > 1000, default["faults_per_step"]
    assert tuned["faults_per_step"] < default["faults_per_step"] / 4, (
        tuned["faults_per_step"],
        default["faults_per_step"],
    )
