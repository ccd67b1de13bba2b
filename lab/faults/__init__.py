"""The fault harness: a seeded, model-based, fault-injecting driver for indexer fleets.

``driver.py`` runs rounds (replicas over one Redis, a Redis Cluster with
replicas, or the memory backend) and checks every answer against
``model.py`` by the invariants of ``invariants.py`` (the contract is
indexer/CONSISTENCY.md); ``ops.py`` is the seeded schedule, ``faults.py`` the
backends and their faults, ``fleet.py`` the replicas, ``engines.py`` the ZMQ
engines. ``kvmesh bench faults`` (lab/bench/faults.py) runs it for longer.
"""
