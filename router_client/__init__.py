"""kvmesh router_client (not built yet; see its README)."""
