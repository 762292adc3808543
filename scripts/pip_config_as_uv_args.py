"""Prints, one per line, the ``uv pip install`` options that give uv the package sources pip is configured
with here (``pip config list``: index-url, extra-index-url, find-links and constraint of the global, install
and environment scopes), so that scripts/setup.sh installs with uv what pip would find.

The indexes come as ``--index`` options in priority order: pip's main index first (its ``index-url``, else
PyPI), then each extra index. uv's default strategy takes a package from the first index that has it, so a
package that PyPI has is never taken from an extra index, whatever version the extra index offers (no
dependency confusion); an extra index serves only what the main index lacks. Find-links folders (a CPU torch
wheel, say) are searched besides the indexes.
"""

from __future__ import annotations

import ast
import subprocess
import sys

PYPI = "https://pypi.org/simple"
SCOPES = {"global", "install", ":env:"}


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    values: dict[str, list[str]] = {"extra-index-url": [], "find-links": [], "constraint": []}
    main_index: dict[str, str] = {}  # scope -> index-url
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if scope not in SCOPES:
            continue
        if name == "index-url":
            main_index[scope] = ast.literal_eval(value).strip()
        elif name in values:
            for item in ast.literal_eval(value).split():
                if item not in values[name]:
                    values[name].append(item)
    # pip's precedence: the environment (PIP_INDEX_URL), then the install section, then global
    indexes = [next((main_index[s] for s in (":env:", "install", "global") if s in main_index), PYPI)]
    indexes += [u for u in values["extra-index-url"] if u not in indexes]
    for url in indexes:
        print("--index")
        print(url)
    for option in ("find-links", "constraint"):
        for item in values[option]:
            print(f"--{option}")
            print(item)


if __name__ == "__main__":
    main()
