"""``cuda_vmm`` in-place privatization (weight updates under CUDA graphs), on CPU with a
fake CUDA driver: the private copy is mapped at the *same* address, the daemon's
memory is never written, a second call copies nothing, and every failing driver call
leaves the read-only import mapped where it was. The real driver runs in
tests/gpu_engine/test_weight_updates_graphs.py (H200)."""

from __future__ import annotations

import contextlib
import enum
import types

import pytest

from wcache.store import StoreError, TransportFailed, attach, transport_vmm
from wcache.store.transport_vmm import VmmMapping, _remap_private

#: Size of the fake mapping (bytes): any multiple of a granularity works for the fake.
SIZE = 4096
#: Where the fake driver puts the engine's mapping and the temporary range.
REAL_VA, TMP_VA = 0x7000_0000, 0x9000_0000


class _Result(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2


class FakeDriver:
    """The cuda-python calls :func:`_remap_private` makes, over a dict of physical
    allocations (handle -> bytearray) and one of mappings (address -> [handle,
    access]). ``fail`` names one call (with ``#n`` for its n-th use) that returns an
    error instead."""

    CUresult = _Result

    def __init__(self, fail: str | None = None):
        self.fail = fail
        self.calls: list[str] = []
        self.phys: dict[int, bytearray] = {1: bytearray(b"d" * SIZE)}  # 1: the daemon's
        self.maps: dict[int, list] = {REAL_VA: [1, "r"]}
        self.reserved = {REAL_VA}
        self.released: list[int] = []
        self.next_handle = 2
        ns = types.SimpleNamespace
        self.CUmemAccess_flags = ns(
            CU_MEM_ACCESS_FLAGS_PROT_READ="r", CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw"
        )
        self.CUmemAllocationType = ns(CU_MEM_ALLOCATION_TYPE_PINNED=0)
        self.CUmemLocationType = ns(CU_MEM_LOCATION_TYPE_DEVICE=0)
        self.CUmemAllocationHandleType = ns(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)

    def CUmemAllocationProp(self):  # noqa: N802  (the driver's names)
        return types.SimpleNamespace(location=types.SimpleNamespace())

    def CUmemAccessDesc(self):  # noqa: N802 (the CUDA driver binding's own name)
        return types.SimpleNamespace(location=types.SimpleNamespace())

    def cuGetErrorName(self, err):  # noqa: N802 (the CUDA driver binding's own name)
        return _Result.CUDA_SUCCESS, err.name

    def _call(self, name: str, value=None):
        self.calls.append(name)
        tag = f"{name}#{self.calls.count(name)}"
        if self.fail in (name, tag):
            return (_Result.CUDA_ERROR_OUT_OF_MEMORY,) + ((None,) if value is not None else ())
        return (_Result.CUDA_SUCCESS,) + ((value,) if value is not None else ())

    def cuCtxSynchronize(self):  # noqa: N802 (the CUDA driver binding's own name)
        return self._call("cuCtxSynchronize")

    def cuMemCreate(self, size, prop, flags):  # noqa: N802 (the CUDA driver binding's own name)
        handle = self.next_handle
        result = self._call("cuMemCreate", handle)
        if result[0] is _Result.CUDA_SUCCESS:
            self.next_handle += 1
            self.phys[handle] = bytearray(size)
        return result

    def cuMemAddressReserve(self, size, align, addr, flags):  # noqa: N802 (the CUDA driver binding's own name)
        result = self._call("cuMemAddressReserve", TMP_VA)
        if result[0] is _Result.CUDA_SUCCESS:
            self.reserved.add(TMP_VA)
        return result

    def cuMemAddressFree(self, ptr, size):  # noqa: N802 (the CUDA driver binding's own name)
        self.reserved.discard(ptr)
        return self._call("cuMemAddressFree")

    def cuMemMap(self, ptr, size, offset, handle, flags):  # noqa: N802 (the CUDA driver binding's own name)
        assert offset == 0 and ptr not in self.maps
        result = self._call("cuMemMap")
        if result[0] is _Result.CUDA_SUCCESS:
            self.maps[ptr] = [handle, None]
        return result

    def cuMemSetAccess(self, ptr, size, descs, count):  # noqa: N802 (the CUDA driver binding's own name)
        result = self._call("cuMemSetAccess")
        if result[0] is _Result.CUDA_SUCCESS:
            self.maps[ptr][1] = descs[0].flags
        return result

    def cuMemcpyDtoD(self, dst, src, size):  # noqa: N802 (the CUDA driver binding's own name)
        result = self._call("cuMemcpyDtoD")
        if result[0] is _Result.CUDA_SUCCESS:
            assert self.maps[dst][1] == "rw"
            self.phys[self.maps[dst][0]][:] = self.phys[self.maps[src][0]][:size]
        return result

    def cuMemUnmap(self, ptr, size):  # noqa: N802 (the CUDA driver binding's own name)
        result = self._call("cuMemUnmap")
        if result[0] is _Result.CUDA_SUCCESS:
            del self.maps[ptr]
        return result

    def cuMemRelease(self, handle):  # noqa: N802 (the CUDA driver binding's own name)
        self.released.append(handle)
        return self._call("cuMemRelease")


def _mapping(cu: FakeDriver) -> VmmMapping:
    return VmmMapping(cu, 1, REAL_VA, SIZE, 0, read_only=True)


@pytest.fixture(autouse=True)
def _no_cuda_context(monkeypatch):
    monkeypatch.setattr(transport_vmm, "_in_context", lambda cu, index: contextlib.nullcontext())


def test_privatize_maps_a_private_copy_at_the_same_address_once():
    """The address maps a new allocation, read-write, holding the daemon's bytes; the
    import is released, the temporary range freed, and a second call copies nothing."""
    cu = FakeDriver()
    mapping = _mapping(cu)
    assert mapping.privatize_() == SIZE
    handle, access = cu.maps[REAL_VA]
    assert (handle, access, mapping.read_only, mapping.ptr) == (2, "rw", False, REAL_VA)
    assert cu.phys[2] == bytearray(b"d" * SIZE) and cu.phys[1] == bytearray(b"d" * SIZE)
    assert set(cu.maps) == {REAL_VA} and cu.reserved == {REAL_VA}
    assert cu.released == [1]
    assert cu.calls.index("cuMemcpyDtoD") < cu.calls.index("cuMemUnmap")
    assert cu.calls[0] == "cuCtxSynchronize"  # nothing queued still reads the range
    calls = len(cu.calls)
    assert mapping.privatize_() == 0 and len(cu.calls) == calls
    mapping._cu = None  # the fake has no device to synchronize at release


FAILING = (
    "cuCtxSynchronize#1",
    "cuMemCreate",
    "cuMemAddressReserve",
    "cuMemMap#1",
    "cuMemSetAccess#1",
    "cuMemcpyDtoD",
    "cuCtxSynchronize#2",
    "cuMemUnmap#1",
    "cuMemMap#2",
    "cuMemSetAccess#2",
)


@pytest.mark.parametrize("fail", FAILING)
def test_a_failing_driver_call_leaves_the_import_mapped(fail):
    """Whichever call fails: TransportFailed naming it, the address maps the daemon's
    allocation read-only again, the private allocation and temporary range are gone."""
    cu = FakeDriver(fail=fail)
    mapping = _mapping(cu)
    with pytest.raises(TransportFailed) as info:
        mapping.privatize_()
    assert fail.split("#")[0] in str(info.value)
    assert cu.maps == {REAL_VA: [1, "r"]}
    assert cu.reserved == {REAL_VA}
    assert 1 not in cu.released
    assert all(h in cu.released for h in cu.phys if h != 1)  # a created private one: released
    assert (mapping.read_only, mapping._handle) == (True, 1)
    mapping._cu = None


def test_a_failed_restore_says_the_range_is_unmapped():
    """If mapping the import back fails too, the error says so (restart the engine)."""
    cu = FakeDriver(fail="cuMemMap#2")
    real_map = cu.cuMemMap

    def map_fails_after_unmap(ptr, size, offset, handle, flags):
        if ptr == REAL_VA:  # both the private map and the restore
            cu.calls.append("cuMemMap")
            return (_Result.CUDA_ERROR_OUT_OF_MEMORY,)
        return real_map(ptr, size, offset, handle, flags)

    cu.cuMemMap = map_fails_after_unmap
    with pytest.raises(TransportFailed, match="unmapped; restart this engine"):
        _remap_private(cu, 1, REAL_VA, SIZE, 0)


def test_privatize_in_place_needs_a_cuda_vmm_attachment(daemon, key, sock_dir):
    """A CPU (shm) attachment keeps addresses through copy on write, and refuses
    privatize_in_place_ by name; a released one says so."""
    with attach(key, socket_dir=sock_dir) as att:
        assert att.keeps_addresses_on_write is True
        with pytest.raises(TransportFailed, match="needs a cuda_vmm zero_copy attachment"):
            att.privatize_in_place_()
    with pytest.raises(StoreError, match="closed"):
        att.privatize_in_place_()
