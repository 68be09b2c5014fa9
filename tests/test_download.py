"""`fedskew data get` against a local HTTP server on 127.0.0.1 that serves archives the tests build in
each official format: download, checksum, resume, refusal of corrupted files, unpacking, then a
short federated run (the in-process harness) on what was installed."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
import re
import socket
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from fedskew import cli
from fedskew.data import DataMissingError, load_arrays
from fedskew.data import download as dl
from fedskew.data.readers import CIFAR_FILES, IDX_FILES, SVHN_FILES, load_dataset, locate
from tests.test_data import write_idx

RNG = np.random.default_rng(0)


# ----------------------------------------------------------------------------- archives in the official formats


def idx_files(tmp: Path) -> dict[str, bytes]:
    """The four gzipped IDX files of MNIST / Fashion-MNIST (every class present)."""
    tmp.mkdir(exist_ok=True)
    for split, n in (("train", 40), ("t10k", 20)):
        write_idx(tmp / f"{split}-images-idx3-ubyte", RNG.integers(0, 256, (n, 28, 28)), gz=True)
        write_idx(tmp / f"{split}-labels-idx1-ubyte", np.arange(n) % 10, gz=True)
    return {p.name: p.read_bytes() for p in sorted(tmp.glob("*.gz"))}


def _pickled_batch(n: int, label_key: bytes, classes: int) -> bytes:
    data = RNG.integers(0, 256, (n, 3072)).astype(np.uint8)
    return pickle.dumps({b"batch_label": b"x", b"data": data, label_key: (np.arange(n) % classes).tolist()}, protocol=2)


def cifar_archive(name: str) -> bytes:
    """cifar-10-python.tar.gz / cifar-100-python.tar.gz: the python batches in their folder, plus
    members a safe unpacker must skip (a path outside the folder, a symlink)."""
    folder, train_files, test_files, label_key = CIFAR_FILES[name]
    classes = 10 if name == "cifar10" else 100
    members = {f: _pickled_batch(100 if name == "cifar100" else 20, label_key, classes) for f in train_files}
    members.update({f: _pickled_batch(10, label_key, classes) for f in test_files})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for fname, blob in [*members.items(), ("readme.html", b"<html/>")]:
            info = tarfile.TarInfo(f"{folder}/{fname}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
        evil = tarfile.TarInfo("../escaped.txt")
        evil.size = 4
        tar.addfile(evil, io.BytesIO(b"evil"))
        link = tarfile.TarInfo(f"{folder}/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return buf.getvalue()


def svhn_files() -> dict[str, bytes]:
    from scipy.io import savemat

    out = {}
    for fname, n in zip(SVHN_FILES, (30, 10), strict=True):
        buf = io.BytesIO()
        savemat(
            buf, {"X": RNG.integers(0, 256, (32, 32, 3, n)).astype(np.uint8), "y": (np.arange(n) % 10 + 1)[:, None]}
        )
        out[fname] = buf.getvalue()
    return out


def official_files(name: str, tmp: Path) -> dict[str, bytes]:
    if name in ("mnist", "fashion-mnist"):
        return idx_files(tmp / "idx-build")
    if name in CIFAR_FILES:
        return {dl.CATALOG[name].files[0].name: cifar_archive(name)}
    return svhn_files()


# ----------------------------------------------------------------------------- the local server


class FileServer(ThreadingHTTPServer):
    """Serves `files` under any /<prefix>/; it can cut a file's first transfer half-way, ignore Range
    for a file, or send other bytes for a path. Records (path, Range header) of every request."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.cut_once: set[str] = set()
        self.corrupt: set[str] = set()
        self.ignore_range: set[str] = set()
        self.no_length: set[str] = set()  # paths served with no Content-Length and the file 7 times over
        self.length: dict[str, str] = {}  # path -> the Content-Length header sent instead of the true one
        self.requests: list[tuple[str, str | None]] = []

    def url(self, prefix: str = "host") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{prefix}/"


class Handler(BaseHTTPRequestHandler):
    server: FileServer

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        rng = self.headers.get("Range")
        self.server.requests.append((self.path, rng))
        if self.path.startswith("/down/") or name not in self.server.files:
            self.send_error(404)
            return
        data = self.server.files[name]
        if self.path in self.server.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = int(re.match(r"bytes=(\d+)-", rng).group(1)) if rng and name not in self.server.ignore_range else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        body = data[start:]
        if self.path in self.server.no_length:
            body *= 7
            self.close_connection = True  # the end of the body is the end of the connection
        else:
            self.send_header("Content-Length", self.server.length.get(self.path, str(len(body))))
        self.end_headers()
        if name in self.server.cut_once:
            self.server.cut_once.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-transfer
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(autouse=True)
def _only_tmp_data(monkeypatch, tmp_path: Path) -> None:
    """The readers look nowhere but the test's folders (no ./data of the checkout, no Debian copy)."""
    from fedskew.data import readers

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    monkeypatch.setattr(readers, "DEBIAN_FMNIST", tmp_path / "no-debian")


@pytest.fixture
def server():
    srv = FileServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def local_catalog(name: str, files: dict[str, bytes], hosts: list[str]) -> dict[str, dl.Source]:
    """The real catalog entry of `name` with the test files' sizes and SHA-256s and local hosts."""
    remotes = tuple(dl.Remote(f, len(b), hashlib.sha256(b).hexdigest()) for f, b in files.items())
    return {name: dataclasses.replace(dl.CATALOG[name], files=remotes, hosts=tuple(hosts))}


def serve(server: FileServer, name: str, monkeypatch: pytest.MonkeyPatch, tmp: Path, hosts: list | None = None) -> dict:
    files = official_files(name, tmp)
    server.files.update(files)
    catalog = local_catalog(name, files, hosts or [server.url()])
    monkeypatch.setattr(dl, "CATALOG", catalog)  # what `fedskew data get` uses
    return files


# ----------------------------------------------------------------------------- tests


def test_the_real_catalog_matches_what_the_readers_read() -> None:
    assert set(dl.CATALOG) == {"mnist", "fashion-mnist", "cifar10", "cifar100", "svhn"}
    for name, source in dl.CATALOG.items():
        assert all(re.fullmatch(r"[0-9a-f]{64}", r.sha256) and r.size > 4000 for r in source.files), name
        assert all(h.startswith(("https://", "http://")) and h.endswith("/") for h in source.hosts), name
        names = {r.name for r in source.files}
        if name in CIFAR_FILES:
            assert source.unpack and source.folder == CIFAR_FILES[name][0]
        elif name == "svhn":
            assert names == set(SVHN_FILES) and source.folder == "svhn"
        else:
            assert names == {f"{s}.gz" for s in IDX_FILES.values()} and source.folder == name
    assert dl.CATALOG["mnist"].hosts[-1].startswith("http://yann.lecun.com")  # the official host, last


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10", "cifar100", "svhn"])
def test_download_verify_unpack_and_read(server, monkeypatch, tmp_path: Path, name: str) -> None:
    serve(server, name, monkeypatch, tmp_path)
    folder = dl.get_dataset(name, str(tmp_path), out=io.StringIO())
    assert folder.parent == tmp_path and locate(name, str(tmp_path)) == folder
    assert not (tmp_path / dl.STAGING).exists()  # staging emptied and removed
    if name in CIFAR_FILES:  # only the archive's own regular files were unpacked
        assert not (tmp_path / "escaped.txt").exists() and not (folder / "link").exists()
        assert (folder / "readme.html").is_file()
    load_dataset.cache_clear()
    x, y, x2, y2 = load_dataset(name, str(tmp_path))
    assert x.dtype == np.uint8 and x.ndim == 4 and len(x) == len(y) > 0 and len(x2) == len(y2) > 0
    load_dataset.cache_clear()
    again = io.StringIO()  # a second `get` finds it and downloads nothing
    n_requests = len(server.requests)
    assert dl.get_dataset(name, str(tmp_path), out=again) == folder and len(server.requests) == n_requests
    assert "present" in again.getvalue()


def test_a_cut_connection_is_resumed_with_a_range_request(server, monkeypatch, tmp_path: Path) -> None:
    files = serve(server, "cifar10", monkeypatch, tmp_path)
    (archive,) = files
    server.cut_once.add(archive)
    out = io.StringIO()
    dl.get_dataset("cifar10", str(tmp_path), out=out)
    ranges = [r for p, r in server.requests if p.endswith(archive)]
    assert ranges == [None, f"bytes={len(files[archive]) // 2}-"]  # the second request resumes at the cut
    assert "100%" in out.getvalue()  # the progress bar reached the end
    assert locate("cifar10", str(tmp_path)) == tmp_path / "cifar-10-batches-py"


def test_a_partial_file_of_an_earlier_run_is_resumed(server, monkeypatch, tmp_path: Path) -> None:
    files = serve(server, "svhn", monkeypatch, tmp_path)
    name, blob = "train_32x32.mat", files["train_32x32.mat"]
    (tmp_path / dl.STAGING).mkdir()
    (tmp_path / dl.STAGING / f"{name}.part").write_bytes(blob[:1000])
    rows = dict(dl.list_datasets(str(tmp_path)))
    assert rows["svhn"].startswith("partial") and "resumes" in rows["svhn"]
    dl.get_dataset("svhn", str(tmp_path), out=io.StringIO())
    assert [r for p, r in server.requests if p.endswith(name)] == ["bytes=1000-"]
    assert (tmp_path / "svhn" / name).read_bytes() == blob


def test_a_host_that_ignores_range_is_read_from_the_start(server, monkeypatch, tmp_path: Path) -> None:
    files = serve(server, "svhn", monkeypatch, tmp_path)
    server.ignore_range.add("test_32x32.mat")
    (tmp_path / dl.STAGING).mkdir()
    (tmp_path / dl.STAGING / "test_32x32.mat.part").write_bytes(b"garbage that is not the file")
    dl.get_dataset("svhn", str(tmp_path), out=io.StringIO())
    assert (tmp_path / "svhn" / "test_32x32.mat").read_bytes() == files["test_32x32.mat"]


def test_a_corrupted_file_is_refused_deleted_and_the_next_host_used(server, monkeypatch, tmp_path: Path) -> None:
    bad = "t10k-labels-idx1-ubyte.gz"
    files = serve(server, "mnist", monkeypatch, tmp_path, hosts=[server.url("bad")])
    server.corrupt.add(f"/bad/{bad}")
    with pytest.raises(dl.DownloadError, match=r"SHA-256 .* is not the expected .*deleted") as info:
        dl.get_dataset("mnist", str(tmp_path), out=io.StringIO())
    assert "\n" not in str(info.value)
    assert not (tmp_path / "mnist").exists() and locate("mnist", str(tmp_path)) is None  # nothing installed
    staged = sorted(p.name for p in (tmp_path / dl.STAGING).iterdir())
    assert staged == list(files)[: list(files).index(bad)]  # the bad file deleted, those verified before kept
    # with a second host that has the right bytes: the bad file comes from there, verified ones are kept
    monkeypatch.setattr(dl, "CATALOG", local_catalog("mnist", files, [server.url("bad"), server.url("good")]))
    n = len(server.requests)
    dl.get_dataset("mnist", str(tmp_path), out=io.StringIO())
    asked = [p for p, _ in server.requests[n:]]
    assert [p for p in asked if p.endswith(bad)] == [f"/bad/{bad}", f"/good/{bad}"]
    assert not any(p.endswith(staged[0]) for p in asked)
    assert (tmp_path / "mnist" / bad).read_bytes() == files[bad]


def test_a_host_offering_another_size_is_refused_before_downloading(server, monkeypatch, tmp_path: Path) -> None:
    files = serve(server, "svhn", monkeypatch, tmp_path)
    server.files["train_32x32.mat"] = files["train_32x32.mat"] + b"extra"
    with pytest.raises(dl.DownloadError, match=r"offers .* bytes, expected"):
        dl.get_dataset("svhn", str(tmp_path), out=io.StringIO())
    assert not (tmp_path / dl.STAGING).exists()


def test_a_host_without_content_length_never_gets_more_than_the_file_size_written(
    server, monkeypatch, tmp_path: Path
) -> None:
    """A host that sends the file 7 times over with no Content-Length: the download stops at the
    file's size, the host counts as failed (its bytes deleted) and the next host delivers the file."""
    files = serve(server, "mnist", monkeypatch, tmp_path, hosts=[server.url("loose"), server.url("good")])
    name = "train-images-idx3-ubyte.gz"
    server.no_length.add(f"/loose/{name}")
    written: list[int] = []
    monkeypatch.setattr(dl.Progress, "update", lambda self, n: written.append(n))
    out = io.StringIO()
    dl.get_dataset("mnist", str(tmp_path), out=out)
    assert (tmp_path / "mnist" / name).read_bytes() == files[name]
    assert [p for p, _ in server.requests if p.endswith(name)] == [f"/loose/{name}", f"/good/{name}"]
    assert sum(written) == sum(len(b) for b in files.values()) + len(files[name])  # the loose host: one size
    monkeypatch.setattr(dl, "CATALOG", local_catalog("mnist", files, [server.url("loose")]))
    (tmp_path / "mnist" / name).unlink()
    with pytest.raises(dl.DownloadError, match=r"sends more than the file's \d+ bytes") as info:
        dl.get_dataset("mnist", str(tmp_path), out=io.StringIO())
    assert "\n" not in str(info.value) and not (tmp_path / dl.STAGING / f"{name}.part").exists()


@pytest.mark.parametrize("header", ["abc", "-5", "1e3", "", "99999999999999999999"])
def test_a_malformed_content_length_is_a_failed_host_and_the_next_one_is_tried(
    server, monkeypatch, tmp_path: Path, capsys, header: str
) -> None:
    files = serve(server, "svhn", monkeypatch, tmp_path, hosts=[server.url("odd"), server.url("good")])
    server.length["/odd/test_32x32.mat"] = header
    assert cli.main(["data", "get", "svhn", "--data-root", str(tmp_path)]) == 0
    assert (tmp_path / "svhn" / "test_32x32.mat").read_bytes() == files["test_32x32.mat"]
    monkeypatch.setattr(dl, "CATALOG", local_catalog("svhn", files, [server.url("odd")]))
    (tmp_path / "svhn" / "test_32x32.mat").unlink()
    capsys.readouterr()
    assert cli.main(["data", "get", "svhn", "--data-root", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # progress of the other file, then one line
    assert "data get failed" in err[-1] and "test_32x32.mat" in err[-1] and "config error" not in " ".join(err)
    assert re.search("malformed Content-Length|offers 9+ bytes", err[-1]), err[-1]


def test_offline_one_line_non_zero_and_nothing_left_behind(monkeypatch, tmp_path: Path, capsys) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused, as offline
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    files = official_files("cifar10", tmp_path)
    monkeypatch.setattr(dl, "CATALOG", local_catalog("cifar10", files, [f"http://127.0.0.1:{port}/x/"]))
    root = tmp_path / "data"
    rc = cli.main(["data", "get", "cifar10", "--data-root", str(root)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "no connection" in err[0] and "cifar-10-python.tar.gz" in err[0]
    assert not root.exists()


def test_cli_get_ls_then_a_short_federated_run_on_the_result(
    server, monkeypatch, tmp_path: Path, capsys, task_identity
) -> None:
    """`fedskew data get cifar10` through the local server, `data ls`, then the real ServerApp and
    ClientApp (in-process harness, 2 clients, 1 round) on the installed files."""
    from tests.harness import run_in_process

    root = tmp_path / "data"
    serve(server, "cifar10", monkeypatch, tmp_path)
    assert cli.main(["data", "get", "cifar10", "--data-root", str(root)]) == 0
    assert "verified (SHA-256) and ready" in capsys.readouterr().err
    assert cli.main(["data", "ls", "--data-root", str(root)]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"cifar10 +present +" + re.escape(str(root / "cifar-10-batches-py")), listing)
    load_dataset.cache_clear()
    cfg = {"dataset": "cifar10", "data-root": str(root), "model": "lenet", "partition": "iid", "min-partition-size": 1}
    cfg.update({"num-server-rounds": 1, "fraction-train": 1.0, "out-dir": str(tmp_path / "out"), "run-name": "r"})
    run_in_process(cfg, 2)
    rows = [json.loads(line) for line in (tmp_path / "out" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["replies"] == 2 and 0.0 <= rows[0]["global-accuracy"] <= 1.0
    load_dataset.cache_clear()


def test_a_missing_data_set_names_the_download_command(tmp_path: Path) -> None:
    from fedskew.config import validate

    load_dataset.cache_clear()
    with pytest.raises(DataMissingError, match=f"fedskew data get svhn --data-root {tmp_path}"):
        load_arrays(validate({"dataset": "svhn", "data-root": str(tmp_path)}))
