"""Prints, one per line, the ``uv pip install`` options that give uv the package sources pip is configured
with here (``pip config list``: index-url, extra-index-url, find-links and constraint of the global, install
and environment scopes), so that scripts/setup.sh installs with uv exactly what pip would find."""

from __future__ import annotations

import ast
import subprocess
import sys

OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    seen: set[tuple[str, str]] = set()
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if name not in OPTIONS or scope not in {"global", "install", ":env:"}:
            continue
        for item in ast.literal_eval(value).split():
            if (name, item) not in seen and not (name == "index-url" and any(n == name for n, _ in seen)):
                seen.add((name, item))
                print(OPTIONS[name])
                print(item)


if __name__ == "__main__":
    main()
