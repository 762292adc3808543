"""Installing a finished model folder in the model cache, safe against concurrent installers."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["install_dir"]


def install_dir(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` directory to ``target`` (replacing an outdated one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, old)
        except OSError:
            return
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process installed it first
        pass
