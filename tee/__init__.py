"""kvmesh tee (not built yet; see its README)."""
