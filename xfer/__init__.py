"""kvmesh xfer: the KV transfer sidecar moving pages from prefill to decode engines.

See xfer/README.md for the file map and docs/xfer.md for the design.
"""
