"""Prefect blocks of prefect-tinker (registered through the ``prefect.collections`` entry point).

- :class:`TinkerCredentials`: hosted Tinker, a self-hosted Tinker-compatible server, or the
  embedded local server; ``get_client()`` returns a ``tinker.ServiceClient``.
"""

from tinker_blocks.credentials import LocalServerError, TinkerCredentials

__all__ = ["LocalServerError", "TinkerCredentials"]
