#!/usr/bin/env bash
# The main job on the embedded default: fine-tune the `tiny` model on the bundled example chat file
# through a Prefect flow and the tinker SDK talking to our local Tinker-compatible server, sample
# from the result, and print an SQL summary of the training store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
. scripts/env.sh
STORE=${STORE:-./demo-store}
RUN=${RUN:-demo-$(date +%Y%m%d-%H%M%S)}
prefect-tinker run sft model=tiny run_name="$RUN" store="$STORE" \
  batch_size=4 max_steps=${MAX_STEPS:-30} learning_rate=1e-3 lora_rank=16 eval_every=10 save_every=10 "$@"
prefect-tinker sql --store "$STORE" \
  "SELECT step, round(value, 4) AS train_loss FROM metrics WHERE run_id = '$RUN' AND name = 'train/loss' ORDER BY step"
prefect-tinker sql --store "$STORE" \
  "SELECT step, kind, path FROM checkpoints WHERE run_id = '$RUN' ORDER BY step, kind"
case " $* " in
  *" model="*) ;;
  *) echo "The samples above (\"samples\" in the run's JSON) come from 'tiny', a random-init test model with no" \
       "pretraining: after a few steps they are not meant to read as text. A real pretrained chat model:" \
       "WITH_SMOLLM2=1 bash scripts/setup.sh, then the same with model=smollm2." ;;
esac
echo "Store: $STORE (query it: prefect-tinker sql --store $STORE \"SELECT ...\")."
echo "The embedded local server keeps running for the next run: 'prefect-tinker local status' / 'prefect-tinker local stop'."
echo "The run in the Prefect UI (progress, curves, metrics): the 'View at' link above, or 'prefect-tinker ui';"
echo "the local Prefect server keeps running too: 'prefect-tinker ui status' / 'prefect-tinker ui stop'."
