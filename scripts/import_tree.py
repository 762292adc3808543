"""Builds build/import-tree/: the installed import layout of the checkout, as links, for static tools.

pyproject.toml's ``[tool.setuptools] package-dir`` maps the repository's folders into the
``prefect_tinker`` namespace (``flows/`` is ``prefect_tinker.flows``); the wheel and the editable
install (an import hook) follow it at run time. Tools that find modules by walking directories
(import-linter's grimp, mypy, an editor without import-hook support) need a folder shaped like the
import names: this script makes one, with one link per top-level entry (directory links, so files
added later are seen without running it again), and prints its path. scripts/lint.sh runs the
import contracts and mypy inside it; an editor can take it as an extra analysis path.

Usage: ``python scripts/import_tree.py`` (rebuilds the folder, prints its absolute path).
Where links cannot be made (a file system without symlinks) the files are copied instead.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "import-tree"


def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        dest.symlink_to(src, target_is_directory=src.is_dir())
    except OSError:
        if src.is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copy2(src, dest)


def build() -> Path:
    """(Re)creates the tree from pyproject.toml's package list and package-dir mapping; returns its path."""
    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools_cfg["package-dir"]
    top_level = sorted({name.split(".")[0] for name in setuptools_cfg["packages"]})
    if TREE.exists():
        shutil.rmtree(TREE)
    TREE.mkdir(parents=True)
    for top in top_level:
        src = ROOT / top
        children = {name.split(".", 1)[1]: folder for name, folder in mapping.items() if name.startswith(top + ".")}
        if not children:
            _link(src, TREE / top)
            continue
        for entry in src.iterdir():  # the package's own files and subpackages, then the mapped folders
            if entry.name != "__pycache__":
                _link(entry, TREE / top / entry.name)
        for child, folder in children.items():
            _link(ROOT / folder, TREE / top / Path(*child.split(".")))
    return TREE


if __name__ == "__main__":
    sys.stdout.write(os.fspath(build()) + "\n")
