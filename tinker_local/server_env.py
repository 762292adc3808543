"""The environment of the embedded local server: only what it needs, never the caller's secrets.

The server (``python -m tinker_local serve``, started by :mod:`tinker_local.launcher` for
``TinkerCredentials(local=True)``) lives
longer than the run that started it, and ``/proc/<pid>/environ`` shows its environment to anyone
allowed to read that file. So it gets only:

- the basics of a process: ``PATH``, ``HOME``, ``USER``, ``LOGNAME``, ``LANG``, ``LANGUAGE``, ``LC_*``,
  ``TZ``, ``TMPDIR`` / ``TEMP`` / ``TMP``, ``PYTHONPATH``, ``PYTHONHOME``, ``VIRTUAL_ENV``,
  ``LD_LIBRARY_PATH``, ``SSL_CERT_FILE``, ``SSL_CERT_DIR``, ``REQUESTS_CA_BUNDLE``, ``XDG_CACHE_HOME``;
- thread counts and accelerator settings: ``OMP_*``, ``MKL_*``, ``OPENBLAS_*``, ``KMP_*``, ``GOMP_*``,
  ``NUMEXPR_*``, ``TORCH_*``, ``PYTORCH_*``, ``CUDA_*``, ``CUBLAS_*``, ``NVIDIA_VISIBLE_DEVICES``,
  ``HIP_VISIBLE_DEVICES``, ``TOKENIZERS_PARALLELISM``;
- model caches and offline flags: ``HF_*``, ``TRANSFORMERS_*``, ``HUGGINGFACE_HUB_CACHE``;
- its own settings: ``TINKER_LOCAL_*``, ``PREFECT_TINKER_HOME``, ``TINKER_TELEMETRY``;

and of those, never a name that looks like a secret (``TOKEN``, ``SECRET``, ``PASSWORD``,
``PASSWD``, ``KEY``, ``CREDENTIAL``, ``AUTH``, ``COOKIE``: e.g. ``HF_TOKEN``). Proxy settings
(``HTTP_PROXY``, ...) may embed passwords and are left out too: the server loads models offline.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["server_environment"]

_EXACT = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TEMP",
        "TMP",
        "PYTHONPATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "XDG_CACHE_HOME",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "TOKENIZERS_PARALLELISM",
        "HUGGINGFACE_HUB_CACHE",
        "PREFECT_TINKER_HOME",
        "TINKER_TELEMETRY",
    }
)
_PREFIXES = (
    "LC_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "KMP_",
    "GOMP_",
    "NUMEXPR_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "CUBLAS_",
    "HF_",
    "TRANSFORMERS_",
    "TINKER_LOCAL_",
)
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH|COOKIE", re.IGNORECASE)
_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}  # local models must not wait on the hub


def server_environment(parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for the embedded server from ``parent`` (default ``os.environ``): the
    allowed names of the module docstring, secrets removed, ``HF_HUB_OFFLINE=1`` and
    ``TINKER_TELEMETRY=0`` unless set."""
    parent = os.environ if parent is None else parent
    env = {k: v for k, v in parent.items() if (k in _EXACT or k.startswith(_PREFIXES)) and not _SECRET.search(k)}
    for k, v in _DEFAULTS.items():
        env.setdefault(k, v)
    return env
