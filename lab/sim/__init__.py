"""Simulated engines and the routing-policy replay (``kvmesh replay``).

Lives outside ``router_client`` because it drives an in-process
:class:`indexer.memory.MemoryIndex`; router_client itself never imports the
indexer service.
"""
