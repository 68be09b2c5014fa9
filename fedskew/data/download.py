"""`fedskew data get NAME`: download a standard data set from its official host, check each file's
size and SHA-256 against the values below, and put it where the readers look; `fedskew data ls`.

Where the values come from (checked on 2026-11-22):
- SHA-256 and sizes: TensorFlow Datasets' checksum files (`tensorflow/datasets`,
  `tensorflow_datasets/url_checksums/`: `mnist.txt`, `fashion_mnist.txt`, `svhn_cropped.txt`, and
  for the python versions of CIFAR `cifar10.csv` / `cifar100.csv` at commit 2740d30f). The CIFAR
  values are also Keras's `file_hash` (`keras/datasets/cifar10.py`, `cifar100.py`).
- Cross-checked against torchvision's MD5 lists (`pytorch/vision`, `torchvision/datasets/mnist.py`,
  `cifar.py`, `svhn.py`), which name the same files and hosts; the MD5s are in the comments.

Hosts: the official ones. MNIST's own host (yann.lecun.com) often refuses downloads, so its files
are tried first from PyTorch's mirror (the one torchvision uses) and Google's CVDF mirror (the one
TFDS uses), then from yann.lecun.com; every copy is the same bytes, which the SHA-256 proves.
Fashion-MNIST's and SVHN's hosts serve plain HTTP only: the SHA-256 check is what makes that safe.
`--mirror URL` (or `$FEDSKEW_DATA_MIRROR`) adds a base URL tried first (e.g. a lab's file server
holding the same file names); its files must pass the same checks.

Each file goes to `<data-root>/.downloads/<file>.part` while it arrives; a cut connection is resumed
with an HTTP Range request (up to 3 tries per host, and on the next `data get`), a finished file is
kept only if its SHA-256 matches (else deleted), and the data set appears under `<data-root>` only
once every file is verified: IDX and .mat files are moved into place, CIFAR's tar.gz is unpacked
(regular files inside its own folder only) into a temporary folder that is then renamed. Offline,
one line says which host failed and nothing is left behind; a verified archive you copied into
`<data-root>/.downloads/` yourself is used without downloading.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fedskew.data.readers import locate

STAGING = ".downloads"
CHUNK = 1 << 16
TRIES_PER_HOST = 3
TIMEOUT_S = 30.0


class DownloadError(RuntimeError):
    """A data set could not be downloaded or verified; the message is one line."""


@dataclass(frozen=True)
class Remote:
    """One file of a data set: its name on the host, size in bytes and SHA-256."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Source:
    """Where a data set's files come from (base URLs, tried in order) and where they go: `folder`
    under the data root, or for a tar archive (`unpack`) the folder it holds."""

    files: tuple[Remote, ...]
    hosts: tuple[str, ...]
    folder: str
    unpack: bool = False


def _files(table: str) -> tuple[Remote, ...]:
    """Remotes from `name size sha256` lines (the layout of TFDS's checksum files, for comparing)."""
    return tuple(Remote(n, int(size), sha) for n, size, sha in (line.split() for line in table.strip().splitlines()))


MNIST_HOSTS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
CATALOG: dict[str, Source] = {
    # torchvision MD5s: f68b3c2d..., d53e105e..., 9fb629c4..., ec29112d...
    "mnist": Source(
        _files("""
train-images-idx3-ubyte.gz  9912422   440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609
train-labels-idx1-ubyte.gz  28881     3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c
t10k-images-idx3-ubyte.gz   1648877   8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6
t10k-labels-idx1-ubyte.gz   4542      f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6
"""),
        MNIST_HOSTS,
        "mnist",
    ),
    # torchvision MD5s: 8d4fb7e6..., 25c81989..., bef4ecab..., bb300cfd...
    "fashion-mnist": Source(
        _files("""
train-images-idx3-ubyte.gz  26421880  3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84
train-labels-idx1-ubyte.gz  29515     a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845
t10k-images-idx3-ubyte.gz   4422102   346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073
t10k-labels-idx1-ubyte.gz   5148      67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5
"""),
        ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        "fashion-mnist",
    ),
    # torchvision MD5 c58f30108f718f92721af3b95e74349a
    "cifar10": Source(
        _files("cifar-10-python.tar.gz  170498071  6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"),
        ("https://www.cs.toronto.edu/~kriz/",),
        "cifar-10-batches-py",
        unpack=True,
    ),
    # torchvision MD5 eb9058c3a382ffc7106e4002c42a8d85
    "cifar100": Source(
        _files("cifar-100-python.tar.gz  169001437  85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7"),
        ("https://www.cs.toronto.edu/~kriz/",),
        "cifar-100-python",
        unpack=True,
    ),
    # torchvision MD5s: e26dedcc434d2e4c54c9b2d4a06d8373, eb5a983be6a315427106f1b164d9cef3
    "svhn": Source(
        _files("""
train_32x32.mat  182040794  435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8
test_32x32.mat   64275384   cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b
"""),
        ("http://ufldl.stanford.edu/housenumbers/",),
        "svhn",
    ),
}


# ----------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on `out` (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, name: str, total: int, done: int, out: TextIO) -> None:
        self.name, self.total, self.done, self.out = name, total, done, out
        self.tty = out.isatty()
        self.t0, self.start, self.last, self.shown = time.monotonic(), done, 0.0, -1

    def update(self, n: int) -> None:
        self.done += n
        pct = 100 * self.done // max(self.total, 1)
        now = time.monotonic()
        if (self.tty and now - self.last > 0.2) or (not self.tty and pct // 10 > self.shown):
            self.last, self.shown = now, pct // 10
            self._draw(pct, now)

    def _draw(self, pct: int, now: float) -> None:
        rate = (self.done - self.start) / max(now - self.t0, 1e-9) / 1e6
        bar = "#" * (pct // 5) + "." * (20 - pct // 5)
        line = f"  {self.name} [{bar}] {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB {pct:3d}% {rate:.1f} MB/s"
        self.out.write(("\r" + line) if self.tty else (line + "\n"))
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


# ----------------------------------------------------------------------------- one file


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


class BadHost(DownloadError):
    """A host that offers or sends other bytes than the file (a wrong or malformed header, more
    bytes than the file has): no point in asking it again; the next host is tried."""


def _offered(resp: http.client.HTTPResponse, have: int, remote: Remote) -> int | None:
    """The bytes the response will carry after the `have` already stored (None when the host does
    not say); raises `BadHost` for a malformed Content-Length or Content-Range, or another file."""
    length = resp.headers.get("Content-Length")
    if length is not None and not (length.isascii() and length.isdigit()):
        raise BadHost(f"the host sends a malformed Content-Length {length[:40]!r}")
    content_range = resp.headers.get("Content-Range", "")
    if have and content_range.split("/")[0] != f"bytes {have}-{remote.size - 1}":
        raise BadHost(f"the host answers the range request for bytes {have}- with {content_range[:60]!r}")
    if length is not None and have + int(length) != remote.size:
        raise BadHost(f"the host offers {have + int(length)} bytes, expected {remote.size}")
    return None if length is None else int(length)


def _fetch(url: str, part: Path, remote: Remote, out: TextIO) -> None:
    """Append the rest of `url` to `part` (resuming from its length with a Range request); raises
    on a connection error or a cut transfer (the bytes received stay for the next try). At most the
    file's size is ever written: a host that sends more (with no Content-Length to say so) raises
    `BadHost`, and its bytes are deleted."""
    have = _size(part)
    headers = {"User-Agent": "fedskew", **({"Range": f"bytes={have}-"} if have else {})}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as resp:
        if have and resp.status != 206:  # the host ignored the range: start again
            have = 0
        length = _offered(resp, have, remote)
        part.parent.mkdir(parents=True, exist_ok=True)  # only now: offline leaves no folder behind
        progress = Progress(remote.name, remote.size, have, out)
        try:
            with open(part, "ab" if have else "wb") as f:
                while (left := remote.size - have) > 0 and (block := resp.read(min(CHUNK, left))):
                    f.write(block)
                    have += len(block)
                    progress.update(len(block))
        finally:
            progress.close()
        if length is None and have == remote.size and resp.read(1):  # no Content-Length bounded it
            part.unlink()
            raise BadHost(f"the host sends more than the file's {remote.size} bytes (deleted what it sent)")
    if _size(part) != remote.size:
        raise http.client.IncompleteRead(b"", remote.size - _size(part))


def _try_host(url: str, part: Path, remote: Remote, out: TextIO) -> str | None:
    """Fetch `url` until `part` is complete, trying again while each try makes progress; None when
    complete, else why not."""
    reason = ""
    for _ in range(TRIES_PER_HOST):
        if _size(part) > remote.size:
            part.unlink()
        if _size(part) == remote.size:
            return None
        before = _size(part)
        try:
            _fetch(url, part, remote, out)
            return None
        except BadHost as e:  # the host offers another file or sends too much: no point in trying again
            return str(e)
        except (OSError, http.client.HTTPException) as e:
            reason = _reason(e)
            if _size(part) <= before:
                return reason
    return reason


def download_file(remote: Remote, hosts: list[str], staging: Path, out: TextIO) -> Path:
    """`staging/<name>`, verified: kept from an earlier run, or downloaded from the first host
    that delivers the right bytes. Raises `DownloadError` with every host's reason."""
    final, part = staging / remote.name, staging / f"{remote.name}.part"
    if _size(final) == remote.size and sha256_of(final) == remote.sha256:
        return final
    reasons = []
    for host in hosts:
        url = host.rstrip("/") + "/" + remote.name
        reason = _try_host(url, part, remote, out)
        if reason is None:
            digest = sha256_of(part)
            if digest == remote.sha256:
                os.replace(part, final)
                return final
            part.unlink()
            reason = f"SHA-256 {digest[:12]}... is not the expected {remote.sha256[:12]}... (file deleted)"
        reasons.append((url, reason))
    if len({r for _, r in reasons}) == 1:  # e.g. offline: say it once
        raise DownloadError(f"cannot get {remote.name} from {', '.join(u for u, _ in reasons)}: {reasons[0][1]}")
    raise DownloadError(f"cannot get {remote.name}: " + "; ".join(f"{u}: {r}" for u, r in reasons))


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return f"no connection ({e.reason})"
    if isinstance(e, http.client.IncompleteRead):
        return "the connection was cut"
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- a data set


def _unpack(archive: Path, folder: str, dest: Path) -> Path:
    """Extract the regular files under `folder/` of a tar archive into `dest/folder` (through a
    temporary folder renamed at the end); links, devices and paths outside `folder/` are skipped."""
    if (dest / folder).exists():
        raise DownloadError(f"{dest / folder} exists but is incomplete: move it away and run again")
    tmp = archive.parent / f"{folder}.unpacking"
    shutil.rmtree(tmp, ignore_errors=True)  # a previous interrupted unpack (our own staging folder)
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if not member.isfile() or parts[:1] != (folder,) or ".." in parts or len(parts) < 2:
                    continue
                target = tmp.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        os.replace(tmp / folder, dest / folder)
    except (OSError, tarfile.TarError) as e:
        raise DownloadError(f"cannot unpack {archive.name}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / folder


def _install(source: Source, staged: list[Path], root: Path) -> Path:
    """Move verified files (or unpack the verified archive) to where the readers look."""
    if source.unpack:
        folder = _unpack(staged[0], source.folder, root)
        staged[0].unlink()
        return folder
    folder = root / source.folder
    folder.mkdir(parents=True, exist_ok=True)
    for path in staged:
        os.replace(path, folder / path.name)
    return folder


def get_dataset(
    name: str,
    data_root: str = "data",
    mirror: str | None = None,
    catalog: Mapping[str, Source] | None = None,
    out: TextIO | None = None,
) -> Path:
    """Download, verify and install `name` under `data_root` unless the readers already find it;
    return the folder the readers will read. Raises `DownloadError` (one line). `catalog`
    replaces `CATALOG` (the tests' local server and checksums)."""
    catalog, out = CATALOG if catalog is None else catalog, sys.stderr if out is None else out
    if name not in catalog:
        raise DownloadError(f"unknown data set {name!r}: one of {', '.join(catalog)}")
    present = locate(name, data_root)
    if present is not None:
        print(f"{name}: present in {present}", file=out)
        return present
    source = catalog[name]
    root = Path(data_root).expanduser()
    staging = root / STAGING
    mirror = mirror if mirror is not None else os.environ.get("FEDSKEW_DATA_MIRROR", "")
    hosts = ([mirror] if mirror else []) + list(source.hosts)
    try:
        staged = [download_file(remote, hosts, staging, out) for remote in source.files]
        folder = _install(source, staged, root)
    finally:
        if staging.is_dir() and not any(staging.iterdir()):
            staging.rmdir()
    print(f"{name}: verified (SHA-256) and ready in {folder}", file=out)
    return folder


def list_datasets(data_root: str = "data", catalog: Mapping[str, Source] | None = None) -> list[tuple[str, str]]:
    """(name, state) for every standard data set: where the readers find it, a partial download,
    or how to get it."""
    catalog, rows = CATALOG if catalog is None else catalog, []
    staging = Path(data_root).expanduser() / STAGING
    for name, source in catalog.items():
        present = locate(name, data_root)
        got = sum(_size(staging / r.name) or _size(staging / f"{r.name}.part") for r in source.files)
        total = sum(r.size for r in source.files)
        if present is not None:
            state = f"present    {present}"
        elif got:
            state = f"partial    {got / 1e6:.1f} of {total / 1e6:.1f} MB in {staging} (fedskew data get {name} resumes)"
        else:
            state = f"missing    fedskew data get {name}  ({total / 1e6:.0f} MB)"
        rows.append((name, state))
    return rows
