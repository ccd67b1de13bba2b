"""RedisClusterProcess(replicas=N): masters with replicas, roles, a failover that loses nothing."""

from __future__ import annotations

import pytest
import redis

from lab.faults.faults import ClusterTarget
from lab.redisproc import RedisClusterProcess


def test_replicas_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="replicas"):
        RedisClusterProcess(replicas=-1)


def test_each_master_has_a_replica_and_a_failover_keeps_the_data(cluster: ClusterTarget) -> None:
    proc = cluster.proc
    assert proc.replicas == 1 and len(proc.nodes) == 6
    masters = proc.masters_now()
    assert len(masters) == 3
    for m in masters:
        assert len(proc.replicas_of(m)) == 1
    rc = redis.RedisCluster(host=proc.host, port=proc.ports[0])
    try:
        rc.set("faults-failover-probe", "kept")
        owner = proc.ports.index(rc.get_node_from_key("faults-failover-probe").port)
        (replica,) = proc.replicas_of(owner)
        proc.failover(replica)
        roles = proc.roles()
        assert roles[replica] is None and roles[owner] == replica
        rc.nodes_manager.initialize()
        assert rc.get("faults-failover-probe") == b"kept"
    finally:
        rc.close()
    with pytest.raises(ValueError, match="not a replica"):
        proc.failover(replica)
