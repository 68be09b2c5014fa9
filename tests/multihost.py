"""Several "hosts" on one machine: Linux network namespaces joined by a bridge (needs root).

`NetLab` creates one namespace per host plus a bridge namespace, gives host i the address
`10.99.<subnet>.<i>`, names the hosts in per-namespace `/etc/netns/<ns>/hosts`, blackholes the
subnet in the root namespace (so nothing can leave the machine by the default route), starts
processes inside the namespaces, and removes all of it again in `close()` (processes first, then
namespaces, hosts files and the route), also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

# Run a command as nobody, the unprivileged user of SuperNodes in the tests. This machine kind keeps
# its Python under /root (0700), so nobody keeps the one capability of reading and traversing any
# path (never of writing one): whatever is read-only for nobody, such as a trusted app store, stays so.
AS_NOBODY = [
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--inh-caps=+dac_read_search",
    "--ambient-caps=+dac_read_search",
]


class NetLabUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no `ip`, a restricted container)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class NetLab:
    """Hosts `name -> 10.99.<subnet>.<octet>` in their own network namespaces, on one bridge."""

    def __init__(self, subnet: int | None = None) -> None:
        if os.geteuid() != 0:
            raise NetLabUnavailable(f"network namespaces need root (the test runs as uid {os.geteuid()})")
        if shutil.which("ip") is None:
            raise NetLabUnavailable("the `ip` command (iproute2) is not installed")
        self.tag = f"fsk{os.getpid() % 100000}"
        self.subnet = subnet if subnet is not None else 1 + os.getpid() % 250
        self.net = f"10.99.{self.subnet}"
        self.hosts: dict[str, str] = {}  # name -> address
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.links: list[str] = []
        self.route = False
        self.bridge = self._add_namespace("br")
        try:
            self._in(self.bridge, "ip", "link", "add", "br0", "type", "bridge")
            self._in(self.bridge, "ip", "link", "set", "br0", "up")
            r = _ip("route", "add", "blackhole", f"{self.net}.0/24", check=False)
            self.route = r.returncode == 0
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _add_namespace(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        r = _ip("netns", "add", ns, check=False)
        if r.returncode != 0:
            if not self.namespaces:
                raise NetLabUnavailable(f"`ip netns add` is not permitted here: {r.stderr.strip()}")
            raise RuntimeError(f"ip netns add {ns}: {r.stderr.strip()}")
        self.namespaces.append(ns)
        self._in(ns, "ip", "link", "set", "lo", "up")
        return ns

    @staticmethod
    def _in(ns: str, *cmd: str) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"in {ns}: {' '.join(cmd)}: {r.stderr.strip()}")

    def add_host(self, name: str, octet: int) -> str:
        """A new host `name` at 10.99.<subnet>.<octet>; returns its namespace."""
        ns = self._add_namespace(name)
        i = len(self.hosts)
        outer, inner = f"{self.tag}v{i}", f"{self.tag}h{i}"  # <= 15 characters
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self.links.append(outer)
        _ip("link", "set", outer, "netns", self.bridge)
        _ip("link", "set", inner, "netns", ns)
        self._in(self.bridge, "ip", "link", "set", outer, "master", "br0", "up")
        self._in(ns, "ip", "link", "set", inner, "name", "eth0")
        self._in(ns, "ip", "addr", "add", f"{self.net}.{octet}/24", "dev", "eth0")
        self._in(ns, "ip", "link", "set", "eth0", "up")
        self.hosts[name] = f"{self.net}.{octet}"
        self._write_hosts_files()
        return ns

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def _write_hosts_files(self) -> None:
        lines = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.hosts.items())
        for name in self.hosts:
            d = Path("/etc/netns") / self.ns(name)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(lines)

    # ------------------------------------------------------------------ processes
    def popen(self, host: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """Start `cmd` on `host` in its own process group (so it can be killed with its children)."""
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *cmd],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def run(self, host: str, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 120):
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *cmd],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
        )

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Kill a process started by `popen` and everything in its process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the whole group, also orphaned children
        for ns in self.namespaces:  # anything still running in our namespaces is ours
            r = _ip("netns", "pids", ns, check=False)
            for pid in r.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.namespaces = []
        for link in self.links:  # only left in the root namespace if add_host failed half-way
            _ip("link", "del", link, check=False)
        self.links = []
        if self.route:
            _ip("route", "del", "blackhole", f"{self.net}.0/24", check=False)
            self.route = False

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
