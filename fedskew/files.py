"""Files written whole or not at all, and checked when read back.

`atomic_write` writes a hidden temporary file beside the target, flushes it to the disk (fsync),
renames it over the target and flushes the folder, so that a crash or a power loss leaves the old
file or the new one, never half of one (and concurrent writers of the same file never mix).
`arrays_digest` is what a cache file of arrays stores (in its name or as a member) so that a
damaged or edited copy is recognised when it is read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace `path` by what `write(file)` writes, durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_folder(path: Path, key: str) -> None:
    """Raise ConfigError (one line, naming the run-config `key`) unless `path` is a folder or can be
    made one: no part of it that exists is a file, and it holds no NUL character."""
    from fedskew.config import ConfigError

    text = str(path)
    if "\0" in text:
        raise ConfigError(f"{key}: {text!r} is not allowed: a path holds no NUL character")
    for part in (Path(path), *Path(path).parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                raise ConfigError(f"{key}: {part} is not a folder (a file is in the way of {path})")
            return


def arrays_digest(arrays: Mapping[str, np.ndarray], keys: Iterable[str]) -> str:
    """SHA-256 (16 hex digits) of the arrays `keys` of `arrays`: each one's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for key in keys:
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.data)
    return h.hexdigest()[:16]
