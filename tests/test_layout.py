"""The checkout is the import tree (plain layout): a module's import name is its path, every folder with an
``__init__.py`` under the three top-level packages is a package the wheel installs, no package folder or file is a
link. (Folder-walking tools read the checkout as it is: scripts/lint.sh, the first step of scripts/test.sh, runs
``lint-imports`` and ``mypy`` plainly at the repository root.)"""

import importlib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = ("prefect_tinker", "tinker_blocks", "tinker_local")


def test_every_package_folder_is_installed_and_no_file_is_a_link():
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOP_LEVEL
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    installed = set(find_packages(str(ROOT), include=[f"{t}*" for t in TOP_LEVEL]))
    assert found == installed
    assert {"prefect_tinker.flows", "prefect_tinker.tasks", "prefect_tinker.recipes.rl.envs"} <= installed
    links = [p for top in TOP_LEVEL for p in (ROOT / top).rglob("*") if p.is_symlink()]
    assert links == []


def test_modules_import_from_the_folder_their_name_spells():
    for name in ("prefect_tinker.flows.sft", "prefect_tinker.cli.main", "tinker_local.engine", "tinker_blocks.stores"):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve() == (ROOT / Path(*name.split("."))).with_suffix(".py").resolve()

