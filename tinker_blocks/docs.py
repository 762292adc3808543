"""Where the blocks are documented: the project README, one section per block family.

Each block type's ``_documentation_url`` (the "Documentation" link of the block type in the Prefect
UI) is :func:`docs_url` of its README section. :data:`PROJECT_URL` is also the ``Homepage`` of
``[project.urls]`` in ``pyproject.toml`` (``tests/test_blocks_standard.py`` checks that they agree
and that every anchor is a heading of ``README.md``).
"""

from __future__ import annotations

__all__ = ["PROJECT_URL", "docs_url"]

#: The project's repository (GitHub layout: ``/blob/main/README.md`` renders the README).
PROJECT_URL = "https://github.com/prefect-tinker/prefect-tinker"


def docs_url(section: str) -> str:
    """URL of README section ``section`` (its GitHub anchor: the heading in lower case, spaces as
    ``-``, punctuation dropped; e.g. ``"backends"`` for ``### Backends``)."""
    return f"{PROJECT_URL}/blob/main/README.md#{section}"
