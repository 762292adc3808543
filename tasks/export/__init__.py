"""Weights out of the trainer: a checkpoint exported as a merged Hugging Face model or a PEFT
adapter, through the SDK's own export path (``save_weights_external`` + signed download URLs),
verified by logprobs against the server every time.

Modules: :mod:`.server` (the SDK calls), :mod:`.download` (safe downloads), :mod:`.adapter`
(reading PEFT LoRA adapters), :mod:`.merge` (the exact merge, tied embeddings, shards),
:mod:`.verify` (logprobs against ``compute_logprobs``), :mod:`.output` (local folder or S3),
:mod:`.task` (the ``export-checkpoint`` task).
"""

from prefect_tinker.tasks.export.task import FORMATS, export_checkpoint, export_key, run_export

__all__ = ["FORMATS", "export_checkpoint", "export_key", "run_export"]
