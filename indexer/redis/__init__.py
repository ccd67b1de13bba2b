"""The Redis backend: connection settings, key names, Lua scripts and the key schema (KEYS.md)."""
