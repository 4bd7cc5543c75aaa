"""Three etcd members for the tests, and for `make etcd` (python -m tests.etcdkit).

Each member gets its own client and peer ports and its own data directory;
by default they all listen on loopback, and `hosts`/`wrap` put each on another
address (a network namespace's: tests/e2e/test_etcd_hosts.py). Where the `etcd`
binary is not installed (Debian: `apt-get install -y etcd-server`), the fixture
skips with one line. A member can be stopped and started again (`stop`, `start`),
which is how the tests take the cluster's quorum away.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.ground.etcd import Etcd, EtcdKV
from phalanx.ground.ports import free_port

__all__ = ["EtcdCluster", "etcd_cluster_of", "etcd_missing"]

READY_S = 30.0
_TRY_S = 1.0
"""One readiness try's bound; READY_S bounds them all."""
_PORT_ATTEMPTS = 3
_IN_USE = "bind: address already in use"


class _PortTaken(AssertionError):
    """A member could not listen: its free port was taken before it bound it."""


_PROBE = (
    "import sys; from phalanx.ground.etcd import Etcd, EtcdKV; "
    "EtcdKV(Etcd([sys.argv[1]], float(sys.argv[2])), 'phalanx-test/').set('ready', b'1')"
)
"""A write through one member, from inside its network namespace (the test's own has no
route there)."""


def etcd_missing() -> str | None:
    """Why no etcd can run here (the line the tests skip with), or None."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install -y etcd-server)"
    return None


@dataclass
class _Member:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    wrap: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def argv(self, cluster: str, token: str) -> list[str]:
        client, peer = f"http://{self.endpoint}", f"http://{self.host}:{self.peer_port}"
        flags = {
            "--name": self.name,
            "--data-dir": str(self.data_dir),
            "--listen-client-urls": client,
            "--advertise-client-urls": client,
            "--listen-peer-urls": peer,
            "--initial-advertise-peer-urls": peer,
            "--initial-cluster": cluster,
            "--initial-cluster-token": token,
            "--initial-cluster-state": "new",
            "--logger": "zap",
            "--log-level": "warn",
        }
        return [*self.wrap, "etcd", *(part for pair in flags.items() for part in pair)]


@dataclass
class EtcdCluster:
    """Three (or `len(hosts)`) etcd members, started and stopped as real processes."""

    root: Path
    hosts: Sequence[str] = ("127.0.0.1", "127.0.0.1", "127.0.0.1")
    wrap: Sequence[Sequence[str]] = ()
    """A command prefix per member (`ip netns exec NS`), or none."""
    members: list[_Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._place()

    def _place(self) -> None:
        """The members, their ports and the cluster's token (again after a port was lost)."""
        self.members = []
        for k, host in enumerate(self.hosts):
            # On loopback the members share one address: free ports each. In namespaces each
            # has its own address, and etcd's own ports.
            ports = (free_port(), free_port()) if not self.wrap else (2379, 2380)
            wrap = list(self.wrap[k]) if self.wrap else []
            data = self.root / f"m{k}"
            self.members.append(_Member(f"m{k}", host, ports[0], ports[1], data, wrap))
        self._cluster = ",".join(f"{m.name}=http://{m.host}:{m.peer_port}" for m in self.members)
        self._token = f"phx{os.getpid()}{time.monotonic_ns()}"

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, k: int | None = None) -> None:
        """Start every member (or member `k` again, on its old data), then wait for a leader.

        A free port is free only until someone binds it: another test's cluster, started
        at the same moment by another pytest worker, may take one first. A member that
        died of it is the whole cluster started again on new ports (a few times)."""
        for attempt in range(_PORT_ATTEMPTS):
            for member in self.members if k is None else [self.members[k]]:
                log = (self.root / f"{member.name}.log").open("ab")
                member.proc = subprocess.Popen(
                    member.argv(self._cluster, self._token), stdout=log, stderr=subprocess.STDOUT
                )
            try:
                self.wait_ready()
                return
            except _PortTaken:
                if k is not None or self.wrap or attempt == _PORT_ATTEMPTS - 1:
                    raise
                self.close()
                for member in self.members:
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                    (self.root / f"{member.name}.log").unlink(missing_ok=True)
                self._place()

    def wait_ready(self) -> None:
        """Until a write through every running member is committed (a leader was elected)."""
        deadline = time.monotonic() + READY_S
        for member in self.members:
            if member.proc is None:
                continue
            if member.wrap:  # in a namespace of its own: asked from inside it
                self._probe_inside(member)
                continue
            # Each try short: a member that died of a taken port leaves that port to whoever
            # took it, which may accept and never answer (one long try was 30 s of nothing).
            kv = EtcdKV(Etcd([member.endpoint], _TRY_S), "phalanx-test/")
            while True:
                try:
                    kv.set("ready", b"1")
                    break
                except (OSError, RuntimeError) as exc:
                    own_log = (self.root / f"{member.name}.log").read_text(errors="replace")
                    if member.proc.poll() is not None and _IN_USE in own_log:
                        kv.close()
                        raise _PortTaken(f"etcd {member.name}: {self.logs()}") from exc
                    if time.monotonic() > deadline:
                        why = f"etcd {member.name} never ready: {self.logs()}"
                        raise AssertionError(why) from exc
                    time.sleep(0.1)
            kv.close()

    def _probe_inside(self, member: _Member) -> None:
        argv = [*member.wrap, sys.executable, "-c", _PROBE, member.endpoint, str(READY_S)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=READY_S + 30, env=env)
        if done.returncode != 0:
            raise AssertionError(f"etcd {member.name} never ready: {done.stderr}\n{self.logs()}")

    def stop(self, k: int) -> None:
        """Stop member `k` (SIGKILL: a host gone, not a clean leave)."""
        proc = self.members[k].proc
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self.members[k].proc = None

    def close(self) -> None:
        for k in range(len(self.members)):
            self.stop(k)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.root.glob("*.log"))
        )


def etcd_cluster_of(root: Path) -> Iterator[EtcdCluster]:
    """A started cluster of three loopback members under `root`, closed afterwards."""
    cluster = EtcdCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def main() -> int:
    """`make etcd`: three members on loopback until Ctrl-C; prints the --rdzv-endpoint."""
    if (why := etcd_missing()) is not None:
        print(why, file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="phalanx-etcd-"))
    cluster = EtcdCluster(root)
    try:
        cluster.start()
        print(f"etcd: 3 members, data in {root}; Ctrl-C stops them", flush=True)
        print(f"--rdzv-backend etcd --rdzv-endpoint {cluster.endpoints}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
