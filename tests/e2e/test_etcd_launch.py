"""`phalanx launch --rdzv-backend etcd --rdzv-endpoint h1:2379,h2:2379,h3:2379`: the launchers
and their workers meet in three real etcd members on loopback instead of node 0's TCPStore,
and train to the same parameters as under the default store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.ground.etcd import Etcd, EtcdKV
from phalanx.ground.ports import free_port
from tests.etcdkit import EtcdCluster
from tests.launchkit import LAUNCH, SCRIPTS, clean_env, finish, launch, start

TRAIN = SCRIPTS / "train_mlp.py"
RUN_S = 90


def _params(out: Path, ranks: range) -> list[dict[str, list[float]]]:
    return [json.loads((out / f"params_{r}.json").read_text())["params"] for r in ranks]


@pytest.mark.slow  # make test trains over etcd in tests/faults/test_live_etcd.py
@pytest.mark.timeout(180)
def test_two_launchers_meet_in_etcd_and_train_as_under_the_default_store(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    etcd_out, tcp_out = tmp_path / "etcd", tmp_path / "tcp"
    etcd_out.mkdir()
    tcp_out.mkdir()
    env = clean_env(OMP_NUM_THREADS="1")
    flags = "--nnodes 2 --nproc-per-node 1 --rdzv-backend etcd --rdzv-id etcdrun"
    flags += f" --rdzv-endpoint {etcd_cluster.endpoints}"
    nodes = [start([*LAUNCH, *flags.split(), TRAIN, etcd_out], env) for _ in range(2)]
    outputs = [finish(node, RUN_S) for node in nodes]
    said = "\n".join(out + err for out, err in outputs)
    assert [node.returncode for node in nodes] == [0, 0], said
    assert said.count("store etcd") == 2 and "this is node 0 of 2" in said, said
    assert "this is node 1 of 2" in said, said
    default = launch("--standalone --nproc-per-node 2", TRAIN, tcp_out, env=env, timeout_s=RUN_S)
    assert default.returncode == 0, default.stdout + default.stderr
    assert _params(etcd_out, range(2)) == _params(tcp_out, range(2))
    # The last launcher to leave let the run's keys go with its lease.
    kv = EtcdKV(Etcd(etcd_cluster.endpoints.split(","), 10.0), "phalanx/etcdrun/")
    assert kv.num_keys() == 0
    kv.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--rdzv-backend etcd", "--rdzv-backend etcd needs --rdzv-endpoint"),
        ("--rdzv-backend etcd --rdzv-endpoint https://h:2379", "phalanx speaks plain HTTP"),
        ("--rdzv-backend zookeeper --rdzv-endpoint h", "--rdzv-backend zookeeper is not one"),
    ],
)
def test_etcd_flags_are_checked_before_anything_starts(flags: str, message: str) -> None:
    result = launch(f"--nnodes 2 {flags}", TRAIN, "out")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_an_unreachable_etcd_is_one_line(tmp_path: Path) -> None:
    gone = f"127.0.0.1:{free_port()}"
    flags = f"--nnodes 2 --rdzv-backend etcd --rdzv-endpoint {gone} --rdzv-conf read_timeout=1"
    result = launch(flags, TRAIN, tmp_path, timeout_s=60)
    assert result.returncode == 203, result.stderr
    assert "has not answered for 1s" in result.stderr and gone in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


# Rank 1 fails its first attempt once rank 0 has written its prefix: the launcher sees a
# worker's exit at once, and would otherwise stop rank 0 before it wrote anything.
_FAILS_ONCE = """
import os, sys, time
from pathlib import Path
rank, restart = os.environ["RANK"], os.environ["PHALANX_RESTART_COUNT"]
Path(sys.argv[1], f"prefix_{rank}_{restart}").write_text(os.environ["PHALANX_ETCD_PREFIX"])
if rank == "1" and restart == "0":
    while not Path(sys.argv[1], "prefix_0_0").exists():
        time.sleep(0.01)
    sys.exit(1)
"""


@pytest.mark.timeout(120)
def test_a_restart_meets_under_its_own_prefix(etcd_cluster: EtcdCluster, tmp_path: Path) -> None:
    """Each attempt's keys live under their own prefix (what a fresh TCPStore per attempt
    is): the restarted workers are told the new one."""
    script = tmp_path / "fails_once.py"
    script.write_text(_FAILS_ONCE)
    flags = "--nproc-per-node 2 --max-restarts 1 --rdzv-backend etcd --rdzv-id again "
    flags += f"--rdzv-endpoint {etcd_cluster.endpoints}"
    result = launch(flags, script, tmp_path, timeout_s=RUN_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restarting the worker group (restart 1 of 1)" in result.stderr, result.stderr
    prefixes = {p.name: p.read_text() for p in tmp_path.glob("prefix_*")}
    assert prefixes["prefix_0_0"] == prefixes["prefix_1_0"] == "phalanx/again/a0/", prefixes
    assert prefixes["prefix_0_1"] == prefixes["prefix_1_1"] == "phalanx/again/a1/", prefixes
