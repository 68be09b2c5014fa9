"""Files written whole or not at all, one writer at a time, and checked when read back.

`atomic_write` writes a hidden temporary file beside the target, flushes it to the disk (fsync),
renames it over the target and flushes the folder, so that a crash, a full disk or a power loss
leaves the old file or the new one, never half of one (and concurrent writers of the same file never
mix); `write_text` is that for text. Every results file, doc and table fedskew writes goes through it.

`locked` holds a lock per run folder or results file (`.<name>.lock` beside it: pid, host, start),
so that a second writer (another `fedskew experiment`, `suite_in_process.py --into-suite`, `fedskew
run` into the same folder, an export into the same result file) is refused in one line naming the
holder instead of interleaving its rounds with the first one's. A lock whose process has ended (on
this host: its pid is gone, or now belongs to a later process) is stale: it is taken over, with a
warning. A lock of another host is never judged stale (its pids are not ours to read).

`arrays_digest` is what a cache file of arrays stores (in its name or as a member) so that a
damaged or edited copy is recognised when it is read back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fedskew.schema import ConfigError


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


def write_text(path: Path, text: str) -> None:
    """`atomic_write` of `text` (UTF-8): a results file, doc or table."""
    data = text.encode()
    atomic_write(path, lambda f: f.write(data))


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
    made one: no part of it that exists is a file, it holds no NUL character, and its deepest
    existing folder takes a new folder (tried: a permission, a read-only disk or a pseudo file system
    such as /proc refuses only then; root passes every permission test)."""
    text = str(path)
    if "\0" in text:
        raise ConfigError(f"{key}: {text!r} is not allowed: a path holds no NUL character")
    for part in (Path(path), *Path(path).parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                raise ConfigError(f"{key}: {part} is not a folder (a file is in the way of {path})")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".fedskew-probe-", dir=part))
            except OSError as e:
                raise ConfigError(
                    f"{key}: {path} cannot be written: {part} takes no new folder ({e.strerror or e})"
                ) from None
            return


# ---------------------------------------------------------------------------------------------- locks


def lock_path(target: Path) -> Path:
    """The lock file of a run folder or results file: `.<name>.lock` beside it."""
    target = Path(target).absolute()
    return target.parent / f".{target.name}.lock"


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None where not known:
    with the pid it names one process, so a pid reused by a later process is not the holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(holder: Mapping[str, Any]) -> bool:
    """Whether the lock's holder may still run: always for another host's."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # not ours to judge: refused, naming the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    start = _process_start(pid)
    return holder.get("start") is None or start is None or start == holder["start"]


def _read_holder(lock: Path) -> dict[str, Any] | None:
    """The lock's record; {} when it holds none we can read; None when it is gone."""
    try:
        holder = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: Mapping[str, Any]) -> str:
    if not holder:
        return "an unreadable lock"
    command = f" ({holder['command']})" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}{command}"


def _try_lock(lock: Path, record: dict[str, Any]) -> bool:
    """Create `lock` holding `record`, whole, unless it exists (a hard link is atomic, so a reader
    never sees half a record; where links are refused, an exclusive create)."""
    data = json.dumps(record).encode()
    tmp = lock.with_name(f"{lock.name}.{record['token']}.tmp")
    try:
        tmp.write_bytes(data)  # a lock need not survive a power loss: its process would not either
        try:
            os.link(tmp, lock)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # a file system without hard links
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(lock)
        raise
    return True


def _remove_if(lock: Path, holder: Mapping[str, Any]) -> None:
    """Remove `lock` if it still holds `holder`'s record; the check and the removal under an flock of
    its folder, so that two processes taking over one stale lock never remove each other's new one."""
    fd = os.open(lock.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _read_holder(lock) == holder:
            os.unlink(lock)
    finally:
        os.close(fd)


def _acquire(target: Path, record: dict[str, Any], wait: float) -> Path:
    lock = lock_path(target)
    lock.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait
    while not _try_lock(lock, record):
        holder = _read_holder(lock)
        if holder is None:
            continue  # released since
        if holder and not _alive(holder):
            warnings.warn(f"{target}: taking over the stale lock of {_describe(holder)}, which has ended", stacklevel=4)
            _remove_if(lock, holder)
            continue
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{target} is in use by {_describe(holder)}: wait for it to end, or delete {lock} if it has"
            )
        time.sleep(0.2)
    return lock


@contextlib.contextmanager
def locked(targets: Iterable[Path], wait: float = 0.0) -> Iterator[None]:
    """Hold the lock of each run folder or results file of `targets` (all of them or none) for the
    block; a target another live process holds is refused (ConfigError, one line naming it) after
    waiting up to `wait` seconds for it."""
    pid = os.getpid()
    record = {
        "pid": pid,
        "host": socket.gethostname(),
        "since": datetime.now().astimezone().isoformat(timespec="seconds"),
        "start": _process_start(pid),
        "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv))[:200],
        "token": uuid.uuid4().hex[:12],
    }
    held: list[Path] = []
    try:
        for target in sorted({Path(t).absolute() for t in targets}):
            held.append(_acquire(target, record, wait))
        yield
    finally:
        for lock in reversed(held):
            with contextlib.suppress(OSError):
                _remove_if(lock, record)


def arrays_digest(arrays: Mapping[str, np.ndarray], keys: Iterable[str]) -> str:
    """SHA-256 (16 hex digits) of the arrays `keys` of `arrays`: each one's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for key in keys:
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.data)
    return h.hexdigest()[:16]
