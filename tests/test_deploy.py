"""The deploy/ scripts' safety rules, quickly and without a network: operator certificates are the
only client certificates, SuperNodes and SuperExecs refuse root and a writable app store, and a
read-only store makes Flower run only the FABs installed in it (the rule `deploy/supernode.sh`
relies on). `tests/test_multihost.py` runs the same scripts as a real deployment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, app_folder
from tests.multihost import AS_NOBODY

DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def _run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def _need(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A folder the unprivileged user can reach (pytest's tmp_path is root's only)."""
    d = Path(tempfile.mkdtemp(prefix="fedskew-deploy-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_only_operator_certificates_are_client_certificates(tmp_path: Path) -> None:
    _need("openssl", "ssh-keygen")
    res = _run([str(DEPLOY / "make-certs.sh"), "-o", str(tmp_path), "-n", "1", "-a", "alice,bob", "-s", "DNS:sl"])
    assert res.returncode == 0, res.stderr

    def verify_as_client(cert: str) -> bool:
        r = _run(
            ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), "-purpose", "sslclient", str(tmp_path / cert)]
        )
        return r.returncode == 0

    assert verify_as_client("alice.crt") and verify_as_client("bob.crt")
    assert not verify_as_client("superlink.pem")  # the server's certificate cannot open the Control API
    san = _run(["openssl", "x509", "-in", str(tmp_path / "superlink.pem"), "-noout", "-ext", "subjectAltName"])
    assert "DNS:sl" in san.stdout and "DNS:localhost" in san.stdout and "IP Address:127.0.0.1" in san.stdout
    assert oct((tmp_path / "alice.key").stat().st_mode & 0o777) == "0o600"
    bad = _run([str(DEPLOY / "make-certs.sh"), "-o", str(tmp_path), "-n", "0", "-a", "ca"])
    assert bad.returncode != 0 and "bad admin name" in bad.stderr  # would overwrite the CA's files


def test_control_tunnel_listens_on_the_loopback_only(tmp_path: Path) -> None:
    for f in ("admin.crt", "admin.key", "ca.crt"):
        (tmp_path / f).write_text("x")
    res = _run(
        [str(DEPLOY / "control-tunnel.sh"), "-s", "sl:8100", "-k", str(tmp_path / "admin"), "-l", "0.0.0.0:8101"]
    )
    if "nginx is required" in res.stderr:
        pytest.skip("nginx is not installed")
    assert res.returncode != 0 and "loopback only" in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the refusal of root, so runs as root")
@pytest.mark.parametrize("script", ["supernode.sh", "superexec.sh"])
def test_nodes_refuse_root(tmp_path: Path, script: str) -> None:
    args = ["-s", "sl:8100", "-k", "key", "-a", str(tmp_path), "--", "partition-id=0"]
    if script == "superexec.sh":
        args = ["-r", "sn:9094", "-a", str(tmp_path)]
    res = _run([str(DEPLOY / script), *args])
    assert res.returncode == 1 and "refusing to run as root" in res.stderr, res.stderr


@pytest.fixture(scope="module")
def trusted_store(shared_dir: Path) -> Path:
    """A store holding this checkout's FAB, built by deploy/trust-app.sh (owned by root, read-only)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as an unprivileged node user")
    store = shared_dir / "store"
    res = _run([str(DEPLOY / "trust-app.sh"), "-s", str(store), str(app_folder(shared_dir))])
    assert res.returncode == 0, res.stderr
    assert "trusted fedskew.fedskew" in res.stdout
    return store


def test_superexec_refuses_a_writable_store(trusted_store: Path, shared_dir: Path) -> None:
    writable = shared_dir / "writable"
    shutil.copytree(trusted_store, writable)
    for p in [writable, *writable.rglob("*")]:
        os.chown(p, 65534, 65534)
        p.chmod(0o755)
    empty = shared_dir / "empty"
    empty.mkdir()
    for store, why in [(writable, "is writable by nobody"), (empty, "no trusted app")]:
        res = _run([*AS_NOBODY, str(DEPLOY / "superexec.sh"), "-r", "127.0.0.1:1", "-a", str(store)])
        assert res.returncode == 1 and why in res.stderr, res.stderr


def test_a_read_only_store_runs_only_its_fabs(trusted_store: Path, shared_dir: Path) -> None:
    """Flower installs a run's FAB under $FLWR_HOME/apps and skips the install when the folder is
    there: the trusted FAB resolves to its installed copy, any other FAB cannot be installed."""
    other = shared_dir / "other-app"
    shutil.copytree(ROOT / "fedskew", other / "fedskew", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", other)
    (other / "fedskew" / "extra.py").write_text("print('this code must never run on a node')\n")
    fabs = {}
    for name, app in [("trusted", app_folder(shared_dir)), ("other", other)]:
        out = shared_dir / f"fab-{name}"
        out.mkdir()
        res = _run([str(BIN / "flwr"), "build", "--app", str(app)], cwd=out, env={"FLWR_HOME": str(out / "home")})
        assert res.returncode == 0, res.stdout + res.stderr
        fabs[name] = next(out.glob("*.fab"))
    probe = (
        "import sys\nfrom pathlib import Path\nfrom flwr.cli.install import install_from_fab\n"
        "for fab in sys.argv[1:]:\n"
        "    try:\n        print('installed', install_from_fab(Path(fab).read_bytes(), skip_prompt=True))\n"
        "    except PermissionError as e:\n        print('refused', e)\n"
    )
    res = _run(
        [*AS_NOBODY, str(BIN / "python"), "-c", probe, str(fabs["trusted"]), str(fabs["other"])],
        env={"FLWR_HOME": str(trusted_store)},
    )
    trusted, other_line = res.stdout.splitlines()
    installed = next((trusted_store / "apps").iterdir())
    assert trusted == f"installed {installed}", res.stdout + res.stderr
    assert other_line.startswith("refused"), res.stdout + res.stderr
    assert [p.name for p in (trusted_store / "apps").iterdir()] == [installed.name]
