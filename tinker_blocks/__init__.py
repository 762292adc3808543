"""Prefect blocks of prefect-tinker (registered through the ``prefect.collections`` entry point).

- :class:`TinkerCredentials`: hosted Tinker, a self-hosted Tinker-compatible server, or the
  embedded local server; ``get_client()`` returns a ``tinker.ServiceClient``.
- :class:`TrainingStore`, :class:`EvalStore`, :class:`CaptureStore`: the stores (runs, metrics,
  checkpoints; eval results and samples; captured samples) as Parquet over a local folder or
  ``s3://``, queried with DuckDB.
- :class:`S3Credentials`: key, secret and endpoint of an S3 or S3-compatible object store.
"""

from tinker_blocks.credentials import LocalServerError, TinkerCredentials
from tinker_blocks.s3 import StoreAccessError, StoreUnavailableError
from tinker_blocks.s3_credentials import S3Credentials
from tinker_blocks.store_io import StoreError
from tinker_blocks.stores import CaptureStore, EvalStore, StoreWriter, TrainingStore

__all__ = [
    "LocalServerError",
    "TinkerCredentials",
    "S3Credentials",
    "StoreError",
    "StoreAccessError",
    "StoreUnavailableError",
    "StoreWriter",
    "TrainingStore",
    "EvalStore",
    "CaptureStore",
]
