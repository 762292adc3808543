"""An unmodified third-party SDK program against ``prefect-tinker local serve --model DIR``.

``tests/third_party/sdk_train_loop.py`` is written like a user's script (public ``tinker`` API
only, configuration from ``TINKER_BASE_URL`` / ``TINKER_API_KEY``): supervised steps, sampling,
one importance-sampling step, save and resume with optimizer, REST listing.  It runs as a
subprocess against the ``clean`` server of ``tests/local_server.py``, which serves a Llama model
directory built in the test session with transformers and tokenizers alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local_server import API_KEY

SCRIPT = Path(__file__).parent / "third_party" / "sdk_train_loop.py"


def test_third_party_training_script_runs_unmodified(local_servers, hf_model_dir, tmp_path):
    server = local_servers["clean"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(TINKER_BASE_URL=server.base_url, TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0",
               HF_HUB_OFFLINE="1", PYTHONPATH="")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(hf_model_dir), "8"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(hf_model_dir) in out["models"]
    losses = out["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert len(out["sample_lengths"]) == 4 and all(0 < n <= 12 for n in out["sample_lengths"])
    assert isinstance(out["sample_text"], str) and out["rl_loss"] == out["rl_loss"]  # not NaN
    assert out["checkpoint"].startswith("tinker://") and out["checkpoint"].endswith("/weights/final")
    # the state checkpoint restores the weights after the RL step exactly (the same forward on them)
    assert out["resumed_loss"] == pytest.approx(out["final_loss"], rel=1e-5, abs=1e-6)
    assert out["checkpoint"].split("/")[2] in out["runs"]
