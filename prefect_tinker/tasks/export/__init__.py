"""Weights out of the trainer: the ``export-checkpoint`` task (:mod:`.task`) over the export engine
:mod:`prefect_tinker.export` (server calls, safe downloads, the exact merge, verification by
logprobs, local or S3 output).
"""

from prefect_tinker.tasks.export.task import FORMATS, export_checkpoint, export_key, run_export

__all__ = ["FORMATS", "export_checkpoint", "export_key", "run_export"]
