"""A real deployment across network namespaces: TLS, SuperNode authentication, operator
certificates, trusted apps only, a rogue host, a node dying.

Hosts (one network namespace each, on a bridge): `superlink` (10.99.S.1: the SuperLink on its
loopback and its gateway on the network), `operator` (10.99.S.2: the `flwr` CLI through
`deploy/control-tunnel.sh`), `rogue` (10.99.S.3: holds only the public `ca.crt`) and `node0`..`node2`
(10.99.S.10-12, SuperNodes run as an unprivileged user). Everything is started with the project's own
scripts (`deploy/make-certs.sh`, `trust-app.sh`, `superlink.sh`, `gateway.sh`, `control-tunnel.sh`,
`supernode.sh`), so the commands of docs/deployment.md are what is tested:

1. a CA, a certificate for `DNS:superlink,IP:10.99.S.1`, an operator certificate, four node keys;
   a trusted app store holding the FAB of this checkout;
2. the SuperLink with TLS and `--enable-supernode-auth` behind the gateway; a node with an
   unregistered key is refused;
3. the rogue host is refused by the gateway: registering its key, submitting a run, and the Runtime
   API all answer 403, and its key is never registered;
4. the operator registers the three keys with `flwr supernode register` and submits a 2-round job
   of `method` (a parameter; FedAvg by default) with `flwr run`, both through the tunnel;
5. node2 is killed (its whole process group, like a machine dying) as soon as round 1 is logged;
   the run must still complete: later rounds aggregate the two remaining replies and the lost
   reply is written to `failures.jsonl`;
6. client state survives between the fresh ClientApp processes of each message: every reply's
   `participations` counter, kept in `context.state` (node1, node2) or on disk (`state-dir`, node0),
   counts 1, 2;
7. each node's partition was cached once on disk (`cache-dir`) and read back from there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from fedskew.config import validate
from fedskew.run.launcher import stage_app
from fedskew.server_app.results import read_jsonl
from tests.multihost import AS_NOBODY, NetLab, NetLabUnavailable

# one machine's network namespaces and blackhole routes: never beside another test that makes them
pytestmark = pytest.mark.xdist_group("netns")

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NUM_PARTITIONS = 60  # the nodes serve partitions 0..2 of 60 (about 800 training images each)
ROUNDS = 2
KILLED = 2
# Methods to run this way; add a stateful method (e.g. "map") here when it exists.
METHODS = [m for m in os.environ.get("FEDSKEW_MULTIHOST_METHODS", "fedavg").split(",") if m]


def _lab_or_skip() -> NetLab:
    try:
        from fedskew.data import load_dataset

        load_dataset("fashion-mnist", "")
    except FileNotFoundError as e:
        pytest.skip(f"Fashion-MNIST is needed for the multi-host job: {e}")
    for tool, why in [
        ("openssl", "to make the TLS certificates"),
        ("ssh-keygen", "to make the node keys"),
        ("nginx", "for the gateway (apt-get install nginx-light)"),
        ("setpriv", "to run the SuperNodes as an unprivileged user"),
    ]:
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin") is None:
            pytest.skip(f"{tool} is needed {why}")
    try:
        return NetLab()
    except NetLabUnavailable as e:
        pytest.skip(f"no network namespaces here, so no multi-host test: {e}")


def _env(home: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    home.mkdir(parents=True, exist_ok=True)
    return env


# A Runtime API call, as a rogue ServerApp process would make it: the gateway must refuse it.
RUNTIME_PROBE = (
    "import sys, httpx; r = httpx.post('https://superlink:8100/v1/runtime/acquire-task', verify=sys.argv[1]);"
    " print('runtime API:', r.status_code)"
)


def _flwr_json(lab: NetLab, args: list[str], env: dict[str, str], cwd: Path, host: str = "operator") -> dict:
    r = lab.run(host, [str(BIN / "flwr"), *args, "--format", "json"], env, cwd)
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"success": False, "error": (r.stdout + r.stderr)[-2000:]}


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path} missing)"


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_deployment_across_namespaces(tmp_path: Path, method: str) -> None:
    t_start = time.monotonic()
    lab = _lab_or_skip()
    logs = tmp_path / "logs"
    logs.mkdir()
    # the nodes' files: where their unprivileged user can reach them (pytest's tmp_path is root's only)
    hosts = Path(tempfile.mkdtemp(prefix="fedskew-multihost-"))
    hosts.chmod(0o755)
    try:
        lab.add_host("superlink", 1)
        lab.add_host("operator", 2)
        lab.add_host("rogue", 3)
        for i in range(3):
            lab.add_host(f"node{i}", 10 + i)
        sl_addr = lab.hosts["superlink"]

        # 1. certificates, keys, and the trusted app store (this checkout's FAB)
        certs = tmp_path / "certs"
        r = os.system(
            f"{ROOT}/deploy/make-certs.sh -o {certs} -n 4 -a admin -s DNS:superlink,IP:{sl_addr} -d 2 >/dev/null"
        )
        assert r == 0, "deploy/make-certs.sh failed"
        store = hosts / "trusted-apps"
        # the app as `flwr build` / `flwr run` accept it wherever the checkout sits (its folder's name
        # must be a valid app name: a clone in e.g. /tmp/tmp.x1Y is not)
        app = stage_app(ROOT, hosts / "operator-app" / "fedskew")
        assert os.system(f"{ROOT}/deploy/trust-app.sh -s {store} {app} >/dev/null") == 0

        # 2. the SuperLink on its host's loopback, the gateway on the network
        sl_log, gw_log = logs / "superlink.log", logs / "gateway.log"
        lab.popen(
            "superlink",
            [f"{ROOT}/deploy/superlink.sh", "-c", str(certs)],
            sl_log,
            _env(tmp_path / "superlink-home"),
            tmp_path,
        )
        lab.popen(
            "superlink",
            [f"{ROOT}/deploy/gateway.sh", "-c", str(certs), "-H", sl_addr, "-p", "8100"],
            gw_log,
            _env(tmp_path / "gateway-home"),
            tmp_path,
        )
        # the operator's CLI reaches the Control API through the tunnel; the rogue's with ca.crt only
        cli_home = tmp_path / "cli-home"
        cli_env = _env(cli_home)
        (cli_home / "config.toml").write_text(
            '[superlink]\ndefault = "op"\n\n[superlink.op]\naddress = "127.0.0.1:8101"\ninsecure = true\n\n'
            f'[superlink.rogue]\naddress = "superlink:8100"\nroot-certificates = "{certs / "ca.crt"}"\n'
        )
        lab.popen(
            "operator",
            [f"{ROOT}/deploy/control-tunnel.sh", "-s", "superlink:8100", "-k", str(certs / "admin")],
            logs / "tunnel.log",
            cli_env,
            tmp_path,
        )
        deadline = time.monotonic() + 90
        while "running on https://" not in _tail(sl_log) or "start worker process" not in _tail(gw_log):
            assert time.monotonic() < deadline, f"SuperLink did not start:\n{_tail(sl_log)}\n{_tail(gw_log)}"
            time.sleep(0.5)

        def supernode(i: int, extra: str = "") -> object:
            host = f"node{i % 3}"
            home = hosts / host
            for d in (home, home / "cache"):
                d.mkdir(exist_ok=True)
                os.chown(d, 65534, 65534)
            key = home / f"node{i}"  # the node's own key, readable by the node's user only
            shutil.copy(certs / f"node{i}", key)
            shutil.copy(certs / "ca.crt", home / "ca.crt")
            os.chown(key, 65534, 65534)
            node_config = f'partition-id={i} num-partitions={NUM_PARTITIONS} cache-dir="{home / "cache"}"'
            return lab.popen(
                host,
                [
                    *AS_NOBODY,
                    f"{ROOT}/deploy/supernode.sh",
                    "-s",
                    "superlink:8100",
                    "-k",
                    str(key),
                    "-a",
                    str(store),
                    "-p",
                    str(9094 + i),
                    "--",
                    node_config + extra,
                ],
                logs / f"node{i}.log",
                {**_env(tmp_path / "unused-flwr-home"), "HOME": str(home)},  # FLWR_HOME: the store (supernode.sh)
                tmp_path,
            )

        intruder = supernode(3)  # its key is never registered: must be refused (checked below)

        # 3. the rogue host: only ca.crt; all at once with 4. to save time
        cli = [str(BIN / "flwr")]
        rogue = {
            "register": lab.popen(
                "rogue",
                [*cli, "supernode", "register", str(certs / "node3.pub"), "rogue"],
                logs / "rogue-register.log",
                cli_env,
                tmp_path,
            ),
            "run": lab.popen(
                "rogue",
                [*cli, "run", str(app), "rogue", "--format", "json"],
                logs / "rogue-run.log",
                cli_env,
                tmp_path,
            ),
            "runtime": lab.popen(
                "rogue",
                [str(BIN / "python"), "-c", RUNTIME_PROBE, str(certs / "ca.crt")],
                logs / "rogue-runtime.log",
                cli_env,
                tmp_path,
            ),
        }

        # 4. the operator registers the three node keys and submits the job, all at once: the
        # ServerApp waits for min-nodes=3 nodes before round 1
        out = tmp_path / "out"
        run_cfg = tmp_path / "run-config.toml"
        run_cfg.write_text(
            "\n".join(
                [
                    f'method = "{method}"',
                    f"num-server-rounds = {ROUNDS}",
                    "fraction-train = 1.0",
                    "min-nodes = 3",
                    f"num-partitions = {NUM_PARTITIONS}",
                    "round-timeout = 120.0",
                    f"eval-every = {ROUNDS}",
                    'partition = "classes-per-client"',
                    "classes-per-client = 2",
                    f'out-dir = "{out}"',
                    'run-name = "multihost"',
                    "",
                ]
            )
        )
        registering = [
            lab.popen(
                "operator",
                [*cli, "supernode", "register", str(certs / f"node{i}.pub"), "op"],
                logs / f"register{i}.log",
                cli_env,
                tmp_path,
            )
            for i in range(3)
        ]
        submit = lab.popen(
            "operator",
            [*cli, "run", str(app), "op", "--run-config", str(run_cfg), "--format", "json"],
            logs / "submit.log",
            cli_env,
            tmp_path,
        )
        for i, p in enumerate(registering):
            assert p.wait(120) == 0 and "registered" in _tail(logs / f"register{i}.log").lower(), _tail(
                logs / f"register{i}.log"
            )
        os.makedirs(hosts / "node0" / "state", exist_ok=True)
        os.chown(hosts / "node0" / "state", 65534, 65534)
        nodes = [supernode(0, f' state-dir="{hosts / "node0" / "state"}"'), supernode(1), supernode(2)]
        submit.wait(120)
        started = json.loads((logs / "submit.log").read_text() or "{}")
        assert "run-id" in started, _tail(logs / "submit.log")
        run_id = started["run-id"]
        run_dir = out / "multihost"
        try:
            intruder.wait(60)
        except Exception:
            lab.kill(intruder)
        assert intruder.returncode not in (None, 0), "a SuperNode with an unregistered key was not refused"
        assert "Failed to activate SuperNode" in _tail(logs / "node3.log")

        # 3. (checked) every attempt of the rogue host was refused by the gateway
        for what, p in rogue.items():
            p.wait(120)
            assert "403" in _tail(logs / f"rogue-{what}.log"), f"rogue {what}: {_tail(logs / f'rogue-{what}.log')}"
        assert rogue["register"].returncode != 0
        assert '"success": false' in _tail(logs / "rogue-run.log")
        registered = _flwr_json(lab, ["supernode", "ls", "op"], cli_env, tmp_path, host="operator")
        assert len(registered.get("nodes", [])) == 3, registered  # the rogue's key is not among them
        runs = _flwr_json(lab, ["ls", "op"], cli_env, tmp_path, host="operator")
        assert [r["run-id"] for r in runs.get("runs", [])] == [str(run_id)], runs  # nor is a run of its

        # 5. kill node2 once round 1 is logged (a thread watching every 0.1 s, so that the CLI's
        # seconds below never let node2 answer round 2 first on a loaded machine); wait for the end
        killed, done = threading.Event(), threading.Event()

        def kill_after_round_1() -> None:
            while not done.wait(0.1):
                if read_jsonl(run_dir / "metrics.jsonl"):
                    lab.kill(nodes[KILLED])
                    killed.set()
                    return

        killer = threading.Thread(target=kill_after_round_1, daemon=True)
        killer.start()
        status, last_ls = "", 0.0
        while not status.startswith("finished"):
            assert time.monotonic() - t_start < 290, (
                f"multi-host run {run_id} too slow (status {status!r})\nSuperLink log:\n{_tail(sl_log)}"
            )
            # the CLI costs a Python start: ask only every 15 s, or once the results are complete
            if (run_dir / "summary.json").is_file() or time.monotonic() - last_ls > 15:
                info = _flwr_json(lab, ["ls", "op", "--run-id", str(run_id)], cli_env, tmp_path)
                status, last_ls = (info.get("runs") or [{}])[0].get("status", ""), time.monotonic()
            time.sleep(0.5)
        done.set()
        killer.join(5)
        log = lab.run("operator", [str(BIN / "flwr"), "log", str(run_id), "op", "--show"], cli_env, tmp_path)
        (logs / "run.log").write_text(log.stdout + log.stderr)
        assert status == "finished:completed", f"{status}\n{_tail(logs / 'run.log', 6000)}"
        assert killed.is_set(), "round 1 was never logged"

        # the results: 3 nodes in round 1, then the two survivors; the lost reply is logged
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
        assert rows[0]["partitions"] == [0, 1, 2] and rows[0]["replies"] == 3
        for r in rows[1:]:
            assert r["partitions"] == [0, 1], r
        failures = read_jsonl(run_dir / "failures.jsonl")
        lost = [f for f in failures if f["partition"] == KILLED]
        assert lost and all(f["round"] >= 2 for f in failures), failures
        assert "dropped reply" in (logs / "run.log").read_text()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds"] == ROUNDS and summary["num-clients"] == NUM_PARTITIONS
        assert 0.0 <= summary["final_global_accuracy"] <= 1.0
        assert all(np.isfinite(r["train-loss"]) for r in rows)
        # the global model was trained and aggregated (two rounds are too few to test accuracy)
        from fedskew.strategies.fedavg import FedAvgStrategy

        initial = FedAvgStrategy(validate({**tomllib.loads(run_cfg.read_text())})).initial_arrays()
        final = torch.load(run_dir / "model.pt", weights_only=True)
        assert final.keys() == initial.to_torch_state_dict().keys()
        assert any(not torch.equal(final[k], v) for k, v in initial.to_torch_state_dict().items())

        # 6. client state survived between the per-message ClientApp processes
        counts = [r["participations"] for r in read_jsonl(run_dir / "timings.jsonl")]
        assert counts == [[1, 1, 1]] + [[r, r] for r in range(2, ROUNDS + 1)]
        on_disk = list((hosts / "node0" / "state").glob("run-*/partition-0/fedskew-participation.json"))
        assert len(on_disk) == 1 and json.loads(on_disk[0].read_text())["rounds"] == list(range(1, ROUNDS + 1))

        # 7. one cached slice per node, written once
        for i in range(3):
            assert len(list((hosts / f"node{i}" / "cache").glob("*.npz"))) == 1
        assert "Uvicorn running on https://" in sl_log.read_text()
        print(f"multi-host test: {time.monotonic() - t_start:.1f} s; failures {failures}")
    finally:
        lab.close()
        shutil.rmtree(hosts, ignore_errors=True)
        assert not any(Path("/etc/netns").glob(f"{lab.tag}-*")), "namespace hosts files left behind"
