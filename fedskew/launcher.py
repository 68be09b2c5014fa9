"""The launcher: validate a run's config, start a private SuperLink, submit the app with `flwr run`,
follow the run to its end and return its summary. Used by the CLI (`fedskew run`) and by the
experiment suites (`fedskew.experiments`); it prints nothing but the run's own log stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import tomllib

from fedskew.config import ConfigError, all_params, parse_overrides, validate
from fedskew.data import is_hf

FLWR_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
}


class RunFailed(RuntimeError):
    """The federated run did not complete."""


def find_app_dir(explicit: str | None) -> Path:
    """The Flower app folder: --app, else the cwd or the checkout holding this package."""
    candidates = [Path(explicit)] if explicit else [Path.cwd(), Path(__file__).resolve().parent.parent]
    for c in candidates:
        pp = c / "pyproject.toml"
        if pp.is_file() and "app" in tomllib.loads(pp.read_text()).get("tool", {}).get("flwr", {}):
            return c.resolve()
    raise ConfigError(f"no Flower app (pyproject.toml with [tool.flwr.app]) in {', '.join(map(str, candidates))}")


def app_defaults(app_dir: Path) -> dict[str, Any]:
    return tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def read_overrides(items: list[str]) -> dict[str, Any]:
    """Merge `--run-config` arguments: 'k=v k2="s"' strings or paths to TOML files."""
    out: dict[str, Any] = {}
    for item in items:
        path = Path(item)
        if item.endswith(".toml") and path.is_file():
            out.update(tomllib.loads(path.read_text()))
        else:
            out.update(parse_overrides(item))
    return out


def prepare_config(app_dir: Path, overrides: dict[str, Any], num_clients: int) -> tuple[dict, dict]:
    """Validate defaults + overrides and check data and partition; return (validated, overrides
    to submit) with `out-dir`/`data-root` (and an `hf:` folder) absolute and `run-name` filled in."""
    overrides = dict(overrides)
    cfg = validate({**app_defaults(app_dir), **overrides})
    overrides["out-dir"] = str(Path(cfg["out-dir"]).expanduser().absolute())
    if cfg["data-root"]:
        overrides["data-root"] = str(Path(cfg["data-root"]).expanduser().absolute())
    hf_folder = Path(cfg["dataset"][3:]).expanduser()
    if is_hf(cfg["dataset"]) and hf_folder.is_dir():  # the clients run elsewhere: an absolute folder
        overrides["dataset"] = f"hf:{hf_folder.absolute()}"
    if not cfg["run-name"]:
        from fedskew.server_app.results import default_run_name

        overrides["run-name"] = default_run_name(cfg, datetime.now().strftime("%Y%m%d-%H%M%S"))
    cfg = validate({**app_defaults(app_dir), **overrides})
    from fedskew.data.clients import client_indices
    from fedskew.training import pick_device

    pick_device(cfg["device"])  # the simulated clients run here
    client_indices(cfg, num_clients)  # raises DataMissingError / PartitionError early
    return cfg, overrides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


class PrivateSuperLink:
    """A SuperLink on a free localhost port, owned (and killed) by this process: a simulation one,
    or (`simulation=False`) a deployment one that SuperNodes connect to without TLS."""

    def __init__(self, home: Path, env: dict[str, str], simulation: bool = True) -> None:
        self.home, self.env, self.simulation = home, env, simulation
        self.port = free_port()
        self.connection = f"fedskew-{self.port}"
        self.log_path = home / f"superlink-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrivateSuperLink:
        self.home.mkdir(parents=True, exist_ok=True)
        cfg = self.home / "config.toml"
        text = (
            cfg.read_text()
            if cfg.is_file()
            else '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
        )
        text += f'\n[superlink.{self.connection}]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        cfg.write_text(text)
        self.proc = subprocess.Popen(
            [
                flwr_bin("flower-superlink"),
                "--insecure",
                *(["--simulation"] if self.simulation else []),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RunFailed(f"flower-superlink exited at start; see {self.log_path}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return self
            time.sleep(0.3)
        raise RunFailed(f"flower-superlink did not answer in 60 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        cfg = self.home / "config.toml"
        if cfg.is_file():  # drop our connection again
            text = cfg.read_text()
            block = f'\n[superlink.{self.connection}]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
            cfg.write_text(text.replace(block, ""))


def _flwr_json(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([flwr_bin("flwr"), *args, "--format", "json"], capture_output=True, text=True, env=env)
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError:
        raise RunFailed(f"`flwr {' '.join(args)}` failed: {(res.stdout + res.stderr).strip()[-2000:]}") from None


def run_simulation(
    app_dir: Path,
    overrides: dict[str, Any],
    num_supernodes: int,
    federation_config: list[str],
    stream: bool = True,
) -> dict[str, Any]:
    """Run one simulation to its end on a private SuperLink; return the summary or raise RunFailed."""
    env = flower_env(app_dir)
    with PrivateSuperLink(Path(env["FLWR_HOME"]), env) as link:
        fed = " ".join([f"num-supernodes={num_supernodes}", *federation_config])
        return submit(app_dir, link, overrides, ["--federation-config", fed], stream)


def flower_env(app_dir: Path) -> dict[str, str]:
    """This environment with Flower's offline settings, its binaries on PATH and a FLWR_HOME."""
    env = {**os.environ, **FLWR_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # flower-superexec etc.
    env.setdefault("FLWR_HOME", str(app_dir / ".flwr-home"))
    return env


def submit(
    app_dir: Path, link: PrivateSuperLink, overrides: dict[str, Any], flwr_args: list[str], stream: bool = True
) -> dict[str, Any]:
    """`flwr run` the app on `link` (extra `flwr_args`), wait for its end; the summary or RunFailed."""
    env = link.env
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "run-config.toml"
        conf.write_text("".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in overrides.items()))
        started = _flwr_json(["run", str(app_dir), link.connection, "--run-config", str(conf), *flwr_args], env)
        if not started.get("success", True) or "run-id" not in started:
            raise RunFailed(f"flwr run refused the job: {started}")
        run_id = started["run-id"]
        logger = subprocess.Popen(
            [flwr_bin("flwr"), "log", str(run_id), link.connection, "--stream"],
            stdout=None if stream else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            status = _wait(run_id, link.connection, env, logger)
        finally:
            time.sleep(1.0)
            logger.terminate()
            logger.wait()
    run_dir = Path(overrides["out-dir"]) / overrides["run-name"]
    summary_path = run_dir / "summary.json"
    if status != "finished:completed" or not summary_path.is_file():
        raise RunFailed(
            f"run {run_id} ended with status {status!r} (results: {run_dir}; SuperLink log: {link.log_path})"
        )
    return json.loads(summary_path.read_text())


def _wait(run_id: int, connection: str, env: dict[str, str], logger: subprocess.Popen) -> str:
    """Poll the run's status (each `flwr ls` costs a Python start, so not too often)."""
    while True:
        for _ in range(10):  # ~5 s, or sooner once the log stream has ended
            time.sleep(0.5)
            if logger.poll() is not None:
                break
        info = _flwr_json(["ls", connection, "--run-id", str(run_id)], env)
        runs = info.get("runs") or []
        status = runs[0].get("status", "") if runs else ""
        if status.startswith("finished"):
            return status


RESUME_FIXED = ("method", "model", "dataset")  # what the checkpoint's arrays and state belong to


def resume_overrides(run_dir: Path, changes: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The config of an earlier run with `changes` applied (and resume=true), and its number of
    clients. Raises ConfigError for a folder that is not a stopped fedskew run, or for `changes`
    to what the checkpoint holds (`RESUME_FIXED`)."""
    run_dir = run_dir.expanduser().absolute()
    if not (run_dir / "checkpoint.pt").is_file():
        raise ConfigError(f"--resume {run_dir}: no checkpoint.pt yet (checkpoint-every rounds must have passed)")
    saved = _read_json(run_dir / "config.json", dict)
    train = _read_json(run_dir / "partition.json", dict).get("train")
    if not isinstance(train, list) or not train:
        raise ConfigError(f"--resume {run_dir / 'partition.json'}: no list of clients under 'train'")
    for key in RESUME_FIXED:
        if key in changes and key in saved and changes[key] != saved[key]:
            raise ConfigError(
                f"--resume: {key}={changes[key]!r} does not match the checkpoint's {key}={saved[key]!r} "
                f"({run_dir / 'config.json'})"
            )
    schema = all_params()
    cfg = {k: v for k, v in saved.items() if k in schema}
    cfg.update({**changes, "resume": True, "out-dir": str(run_dir.parent), "run-name": run_dir.name})
    return cfg, len(train)


def _read_json(path: Path, kind: type) -> Any:
    """The JSON value in `path`, which must be a `kind`; ConfigError naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {path}: not readable as JSON ({e})") from None
    if not isinstance(value, kind):
        raise ConfigError(f"--resume {path}: holds a {type(value).__name__}, expected a JSON {kind.__name__}")
    return value
