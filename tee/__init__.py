"""kvmesh tee: takes routed-request events off the serving path without blocking it and
forwards them with bounded concurrency to sinks (the cache simulator first of all).

See tee/README.md for the file map.
"""
