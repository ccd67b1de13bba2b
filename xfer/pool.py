"""The KV pool: one shared-memory region that an engine and its sidecar both map.

Layout: ``page_count`` pages of ``page_size`` bytes, then ``aux_count`` aux
slots of ``aux_size`` bytes (per-request metadata such as the first output
token). The region is a file (by default under /dev/shm), so the engine
creates it and the sidecar attaches by path; the NIXL backend registers the
whole region as one DRAM segment. Every index is checked here before any byte
is written (:meth:`KVPool.check_pages`, :meth:`KVPool.check_aux`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument


@dataclass(frozen=True)
class PoolGeometry:
    """Sizes of a pool. All fields must be positive (aux_count may be 0)."""

    page_size: int
    page_count: int
    aux_size: int = 64
    aux_count: int = 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of the page region."""
        return self.page_size * self.page_count

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole region (pages + aux)."""
        return self.kv_bytes + self.aux_size * self.aux_count

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` for a geometry that cannot be mapped."""
        if self.page_size <= 0 or self.page_count <= 0:
            raise InvalidArgument("page_size and page_count must be positive", field="pool")
        if self.aux_size <= 0 or self.aux_count < 0:
            raise InvalidArgument("aux_size must be positive, aux_count >= 0", field="pool")


class KVPool:
    """A mapped pool. Create with :meth:`create` (engine) or :meth:`attach` (sidecar).

    Thread-safe for reads and writes of disjoint pages (it is plain memory).
    """

    def __init__(
        self, path: str, geometry: PoolGeometry, *, create: bool, populate: bool = False
    ) -> None:
        geometry.validate()
        self.path = path
        self.geometry = geometry
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            size = os.fstat(fd).st_size
            if create and size < geometry.total_bytes:
                os.ftruncate(fd, geometry.total_bytes)
            elif not create and size < geometry.total_bytes:
                raise InvalidArgument(
                    f"pool file {path} has {size} bytes, geometry needs {geometry.total_bytes}",
                    field="pool",
                )
            # MAP_POPULATE (Linux): every page mapped now, none on a transfer's first use.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(fd, geometry.total_bytes, flags=flags)
        finally:
            os.close(fd)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mm)
        #: Virtual address of the region's first byte in this process.
        self.base_address: int = ctypes.addressof(self._anchor)
        #: The whole region as a writable memoryview.
        self.view: memoryview = memoryview(self._mm)

    @classmethod
    def create(cls, path: str, geometry: PoolGeometry, populate: bool = False) -> KVPool:
        """Create (or reuse and grow) the pool file at ``path`` and map it (``populate``:
        every page mapped now, see :attr:`xfer.config.PoolSettings.populate`)."""
        return cls(path, geometry, create=True, populate=populate)

    @classmethod
    def attach(cls, path: str, geometry: PoolGeometry, populate: bool = False) -> KVPool:
        """Map an existing pool file; it must be at least as large as ``geometry`` needs
        (``populate``: every page mapped now)."""
        return cls(path, geometry, create=False, populate=populate)

    # -- bounds ----------------------------------------------------------------

    def check_pages(self, indices: Sequence[int], field: str) -> None:
        """Raise :class:`InvalidArgument` unless every index is in ``[0, page_count)``."""
        n = self.geometry.page_count
        if not indices or (min(indices) >= 0 and max(indices) < n):
            return
        for i in indices:
            if not 0 <= i < n:
                raise InvalidArgument(f"page index {i} outside [0, {n})", field=field)

    def check_aux(self, index: int, field: str) -> None:
        """Raise :class:`InvalidArgument` unless ``index`` is an aux slot of this pool."""
        n = self.geometry.aux_count
        if not 0 <= index < n:
            raise InvalidArgument(f"aux index {index} outside [0, {n})", field=field)

    def check_range(self, offset: int, length: int) -> None:
        """Raise :class:`InvalidArgument` unless ``[offset, offset+length)`` lies in the pool."""
        if offset < 0 or length <= 0 or offset + length > self.geometry.total_bytes:
            raise InvalidArgument(
                f"byte range [{offset}, {offset + length}) outside the pool "
                f"({self.geometry.total_bytes} bytes)",
                field="range",
            )

    # -- addressing --------------------------------------------------------------

    def page_offset(self, index: int) -> int:
        """Byte offset of page ``index``."""
        return index * self.geometry.page_size

    def aux_offset(self, index: int) -> int:
        """Byte offset of aux slot ``index``."""
        return self.geometry.kv_bytes + index * self.geometry.aux_size

    def page(self, index: int) -> memoryview:
        """Page ``index`` as a writable view (bounds-checked)."""
        self.check_pages([index], "page")
        off = self.page_offset(index)
        return self.view[off : off + self.geometry.page_size]

    def aux(self, index: int) -> memoryview:
        """Aux slot ``index`` as a writable view (bounds-checked)."""
        self.check_aux(index, "aux")
        off = self.aux_offset(index)
        return self.view[off : off + self.geometry.aux_size]

    def close(self) -> None:
        """Unmap (the file stays; see :meth:`unlink`)."""
        self.view.release()
        self._anchor = None
        self._mm.close()

    def unlink(self) -> None:
        """Remove the pool file (mappings stay valid until closed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
