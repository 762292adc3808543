"""Prefect blocks of prefect-tinker (registered through the ``prefect.collections`` entry point).

- :class:`TinkerCredentials`: hosted Tinker, a self-hosted Tinker-compatible server, or the
  embedded local server; ``get_client()`` returns a ``tinker.ServiceClient``.
- :class:`TrainingStore`: the training store (runs, metrics, checkpoints as Parquet) over a local
  folder or ``s3://``, queried with DuckDB.
"""

from tinker_blocks.credentials import LocalServerError, TinkerCredentials
from tinker_blocks.store_io import StoreError
from tinker_blocks.stores import StoreWriter, TrainingStore

__all__ = ["LocalServerError", "TinkerCredentials", "StoreError", "StoreWriter", "TrainingStore"]
