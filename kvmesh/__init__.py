"""kvmesh: shared pieces every component imports.

``kvmesh.blockkeys`` is the one implementation of the block-key spec
(docs/spec/block-keys.md); ``kvmesh.<service>.v1`` hold the stubs generated
from proto/ (never edited by hand).
"""

__version__ = "0.1.0"
