"""The checkout is the import tree (pyproject.toml's one package-dir mapping): no symlinks among the
package folders, every folder with an ``__init__.py`` is a listed package, and the mapped names import
from the folders the mapping names."""

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(package: str) -> Path:
    """The checkout folder of ``package`` by the mapping (longest mapped prefix wins)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in SETUPTOOLS["package-dir"]:
            return ROOT / SETUPTOOLS["package-dir"][prefix] / Path(*parts[n:])
    return ROOT / Path(*parts)


def test_every_package_folder_is_listed_and_no_folder_is_a_symlink():
    listed = {_folder(p).resolve() for p in SETUPTOOLS["packages"]}
    roots = {_folder(p) for p in SETUPTOOLS["packages"] if "." not in p} | {
        ROOT / f for f in SETUPTOOLS["package-dir"].values()
    }
    found = set()
    for root in roots:
        assert not root.is_symlink(), root
        for init in root.rglob("__init__.py"):
            assert "__pycache__" not in init.parts
            found.add(init.parent.resolve())
    assert found == listed
    links = [p for p in (ROOT / "prefect_tinker").rglob("*") if p.is_symlink()]
    assert links == []


def test_mapped_packages_import_from_their_folders():
    for package, folder in SETUPTOOLS["package-dir"].items():
        module = importlib.import_module(package)
        assert [Path(p).resolve() for p in module.__path__] == [(ROOT / folder).resolve()], package
    sft = importlib.import_module("prefect_tinker.flows.sft")
    assert Path(sft.__file__).resolve() == (ROOT / "flows" / "sft.py").resolve()
