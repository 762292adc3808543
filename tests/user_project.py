"""A Prefect user's own project folder for namespace tests: its own ``tasks.py``,
``flows/__init__.py`` and ``recipes/__init__.py``, each raising when imported, so any code of ours
that imported a generic top-level name (``import tasks``) would fail loudly."""

from __future__ import annotations

from pathlib import Path

TRAP = 'raise RuntimeError("the user\'s own {name} was imported by prefect-tinker")\n'


def make_user_project(folder: Path) -> Path:
    """Create the folder with the three trap modules; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tasks.py").write_text(TRAP.format(name="tasks.py"))
    for pkg in ("flows", "recipes"):
        (folder / pkg).mkdir(exist_ok=True)
        (folder / pkg / "__init__.py").write_text(TRAP.format(name=f"{pkg}/__init__.py"))
    return folder
