"""Files relax writes for later runs to read (checkpoint markers, saved rollouts)."""

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` under a temporary name, flushed to disk, then rename it: a crash leaves
    either the old file or the whole new one, never half a file."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
