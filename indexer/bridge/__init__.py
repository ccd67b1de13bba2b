"""The engine-side bridge (``kvmesh bridge``): an engine's KV events to the indexer Service."""
