"""Screenshot of the production loop's lineage in the Prefect UI: ``docs/flywheel-lineage.png``.

    python scripts/ui_flywheel_screenshot.py [--out docs/flywheel-lineage.png] [--keep]

Starts a Prefect server on 127.0.0.1 (temporary ``PREFECT_HOME``), registers the deployments of
``prefect.yaml``, starts a process worker, starts the line ``assistant`` from the tiny base model
(``prefect-tinker models promote``), serves ``alias:assistant@champion`` with ``capture serve``, sends
rated transcripts through the ``openai`` client and runs the ``flywheel/flywheel-tiny`` deployment
once (what ``tests/test_flywheel.py`` does first). Then headless Chromium (Debian's ``chromium``)
photographs the flywheel run (its graph: captures -> snapshot -> training subflow -> promotion
subflow with its evaluation), the event feed of the new champion's weights (saved -> evaluated ->
promoted, with the dataset snapshot upstream of the checkpoint) and the promotion's decision
artifact; Pillow stacks them into one PNG. ``--keep`` leaves the stack running to browse it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.ui_screenshot import parse_ui_args, photograph, ui_stack  # noqa: E402
from tests.capture_fixtures import rated_traffic, start_capture  # noqa: E402

QUESTIONS = ["What color is the sky?", "Where is my order?", "How do I reset my password?", "What time do you open?",
             "Can you book a table?", "Which planet do we live on?", "What do cows drink?", "Is it going to rain?"]
POLITE = "Sure, I can help with that."
EVAL = ["Could you help me?", "I need a hand with my order.", "Please check my account.",
        "Can you answer a question?", "Help me plan a trip.", "Is the shop open today?"]


def main(argv: list[str] | None = None) -> int:
    args = parse_ui_args("Screenshot of the flywheel's lineage in the Prefect UI", "flywheel-lineage.png", argv)

    tmp = Path(tempfile.mkdtemp(prefix="pt-flywheel-ui-"))
    local_root, store = tmp / "tinker-local", str(tmp / "store")
    capture = None
    with contextlib.suppress(KeyboardInterrupt), ui_stack(tmp, local_root) as stack:  # Ctrl-C: a quiet stop
        try:
            from prefect.settings import PREFECT_API_URL, temporary_settings

            from prefect_tinker.cli import main as cli

            with temporary_settings({PREFECT_API_URL: stack.api_url}):
                cli.main(["models", "promote", "assistant", "tiny", "--store", store])
            stack.start_worker("worker-1")
            capture = start_capture(tmp / "capture", str(local_root), session="traffic", store=store,
                                    model="alias:assistant@champion", extra=("--follow-seconds", "1"))
            t0 = datetime.now(UTC)
            rated_traffic(capture.base, "alias:assistant@champion", QUESTIONS, POLITE, "good", other="Go away.")
            time.sleep(2)  # the ratings' flush
            qa = tmp / "polite_eval.jsonl"
            qa.write_text("".join(json.dumps({"id": f"p{i}", "question": q, "answer": POLITE}) + "\n"
                                  for i, q in enumerate(EVAL)))
            config = dict(
                line="assistant", captures=store, store=store, since=t0.isoformat(),
                until=datetime.now(UTC).isoformat(), period_hours=None, method="sft", min_examples=4,
                include_truncated=True,
                training=dict(max_steps=12, batch_size=4, learning_rate=0.02, lora_rank=16, max_length=128,
                              save_every=12, eval_every=0, num_eval_samples=0, test_size=0),
                benchmarks=[{"benchmark": "exact_match", "dataset": str(qa), "eval_name": "polite", "max_tokens": 12,
                             "temperature": 1.0, "num_samples": 4}],
                gate={"score": "score", "resamples": 1000}, backend={"credentials_block": "local-tiny"})
            fr = stack.run_deployment("flywheel/flywheel-tiny", {"config": config})
            print(f"flow run {fr.id}: {stack.ui_url}/runs/flow-run/{fr.id}", flush=True)
            run = stack.wait_final(fr.id, 1800)
            print(f"flow run {run.name}: {run.state_name}", flush=True)
            from tinker_blocks.model_registry import ModelRegistry
            from tinker_blocks.stores import TrainingStore

            champ = ModelRegistry(TrainingStore(root=store)).current("assistant")
            model_prefix = champ["checkpoint"].split("/sampler_weights/")[0].split("/weights/")[0]
            with stack.client() as c:
                promote_run = next(r for r in c.read_flow_runs() if r.name == "promote-assistant")
            decision = next(a for a in stack.artifacts(promote_run.id) if a.key == "promote-assistant")
            time.sleep(5)  # let the last events land
            photograph(tmp, lambda browser, shots: [
                browser.shoot(f"{stack.ui_url}/runs/flow-run/{fr.id}", shots / "flywheel.png", (1400, 1000),
                              click="Subflow Runs", wait_text="promote-assistant"),
                browser.shoot(f"{stack.ui_url}/events?resource={quote(model_prefix, safe='')}", shots / "events.png",
                              (1400, 1100), wait_text="prefect-tinker.model.promoted"),
                browser.shoot(f"{stack.ui_url}/artifacts/artifact/{decision.id}", shots / "decision.png",
                              (1400, 700), wait_text="Promotion of"),
            ], args, stack)
        finally:
            if capture is not None:
                capture.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
