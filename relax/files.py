"""Files relax writes for later runs to read (checkpoint markers, saved rollouts)."""

import os
from pathlib import Path


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` under a temporary name, flushed to disk, then rename it: a crash leaves either the old
    file or the whole new one, never half a file."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def write_text_atomically(path: Path, text: str) -> None:
    """`text` (UTF-8) to `path`, as write_bytes_atomically writes."""
    write_bytes_atomically(path, text.encode("utf-8"))
