"""The lab: everything that drives the whole stack on one machine.

`kvmesh up`, simulated engines and the replay, benchmarks and the soak, the
quickstart, workloads, the bundled trace, local Redis processes and a
development PKI. Services never import this package; it imports them.
"""
