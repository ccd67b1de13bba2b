"""kvmesh indexer: ingests KV-cache events and answers longest-prefix matches."""
