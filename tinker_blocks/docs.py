"""Where the blocks are documented: a page of the documentation site (``docs/``), one per block family.

Each block type's ``_documentation_url`` (the "Documentation" link of the block type in the Prefect
UI) is :func:`docs_url` of its page, as GitHub renders it. :data:`PROJECT_URL` is also the
``Homepage`` of ``[project.urls]`` in ``pyproject.toml`` (``tests/test_blocks_standard.py`` checks that
they agree and that every page exists and is in the site's ``mkdocs.yml`` navigation).
"""

from __future__ import annotations

__all__ = ["PROJECT_URL", "docs_url"]

#: The project's repository (GitHub layout: ``/blob/main/docs/PAGE.md`` renders a documentation page).
PROJECT_URL = "https://github.com/prefect-tinker/prefect-tinker"


def docs_url(page: str) -> str:
    """URL of documentation page ``docs/<page>.md`` (e.g. ``"backends"``) on GitHub."""
    return f"{PROJECT_URL}/blob/main/docs/{page}.md"
