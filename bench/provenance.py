"""Where a benchmark's figures came from: the commit of the tree that measured them."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(root: Path) -> str:
    """``git rev-parse HEAD`` of ``root``, with ``-dirty`` when its tree has changes; ``unknown``
    where git is not there."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
