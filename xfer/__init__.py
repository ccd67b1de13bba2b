"""kvmesh xfer (not built yet; see its README)."""
