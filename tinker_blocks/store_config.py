"""Where the stores are and how long their remote calls retry, from the environment (no Prefect
import): the default store root (``$PREFECT_TINKER_STORE``, ``$PREFECT_TINKER_HOME/store``,
``~/.prefect-tinker/store``), the outage window of remote stores
(``$PREFECT_TINKER_STORE_RETRY_SECONDS``, default 300 s) and the fsspec options of a root
(``s3://`` roots default to the AWS environment variables).  Used by
:class:`~tinker_blocks.store_io.ParquetStore`, the store blocks and everything that opens a
store root or an ``s3://`` URL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tinker_blocks.s3 import s3_storage_options
from tinker_blocks.store_schemas import StoreError

#: default seconds the remote store's writes, reads and lease renewals keep retrying transient
#: errors (an outage) before giving up; ``$PREFECT_TINKER_STORE_RETRY_SECONDS`` overrides it
DEFAULT_RETRY_SECONDS = 300.0
RETRY_SECONDS_ENV = "PREFECT_TINKER_STORE_RETRY_SECONDS"


def default_retry_seconds() -> float:
    """The stores' default outage window: ``$PREFECT_TINKER_STORE_RETRY_SECONDS`` when set, else
    :data:`DEFAULT_RETRY_SECONDS` (300).

    Raises:
        StoreError: the variable is set but not a positive number (the message names it and its value).
    """
    raw = os.environ.get(RETRY_SECONDS_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise StoreError(f"{RETRY_SECONDS_ENV}={raw!r}: give a positive number of seconds")
    return value


def default_store_root() -> str:
    """Default store root: ``$PREFECT_TINKER_STORE``, else ``$PREFECT_TINKER_HOME/store``,
    else ``~/.prefect-tinker/store``."""
    env = os.environ.get("PREFECT_TINKER_STORE")
    if env:
        return env
    home = os.environ.get("PREFECT_TINKER_HOME") or os.path.join(os.path.expanduser("~"), ".prefect-tinker")
    return os.path.join(home, "store")


def resolve_storage_options(root: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for ``root``: ``storage_options`` when given; for ``s3://`` roots without
    them, :func:`~tinker_blocks.s3.s3_storage_options` (the AWS environment variables)."""
    if storage_options is not None:
        return dict(storage_options)
    if str(root).startswith(("s3://", "s3a://")):
        return s3_storage_options()
    return {}
