"""GPU memory whose physical pages go back to the driver and return at the same addresses.

The rollout engine's KV cache is the largest thing it keeps between rollouts (a 7B at 64 x 1,280 slots: 4.4 GiB; a
32B: 21 GiB), and its CUDA graphs hold that cache by address: freeing it would mean recapturing every graph. With
the driver's virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap, what vLLM's sleep mode uses),
the address range stays reserved while the physical memory goes back to the driver for the update, and is mapped
again at the same addresses before the next rollout. Graphs stay valid; the contents do not survive (the engine
zeroes the cache when it maps it again).

Memory mapped here is outside PyTorch's caching allocator: `torch.cuda.memory_allocated` does not count it,
`mapped_bytes` does (the trainer adds it to its peak-memory figure). The converse also happens: vLLM's sleep mode
unmaps its memory pool's pages under live PyTorch tensors, which `torch.cuda.memory_allocated` goes on counting;
the backend that sleeps it declares those bytes (`set_released_bytes`), and the trainer takes them off.
"""
from __future__ import annotations

import ctypes
import threading

import torch

__all__ = ["ReleasableBuffer", "mapped_bytes", "released_bytes", "set_released_bytes", "Unsupported"]

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2


class Unsupported(RuntimeError):
    """This process cannot map releasable memory (no CUDA driver library, or a device without virtual memory
    management); callers fall back to ordinary allocations."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver = None
_lock = threading.Lock()
_mapped: dict[int, int] = {}  # device index -> bytes mapped now
_released: dict[int, int] = {}  # device index -> bytes PyTorch counts as allocated whose pages are released now


def _cuda():
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise Unsupported(f"the CUDA driver library does not load: {e}") from None
        u64, size, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        sig = {
            "cuMemGetAllocationGranularity": (ptr(size), ptr(_AllocationProp), ctypes.c_int),
            "cuMemAddressReserve": (ptr(u64), size, size, u64, u64),
            "cuMemAddressFree": (u64, size),
            "cuMemCreate": (ptr(u64), size, ptr(_AllocationProp), u64),
            "cuMemRelease": (u64,),
            "cuMemMap": (u64, size, size, u64, u64),
            "cuMemUnmap": (u64, size),
            "cuMemSetAccess": (u64, size, ptr(_AccessDesc), size),
            "cuGetErrorString": (ctypes.c_int, ptr(ctypes.c_char_p)),
        }
        for name, argtypes in sig.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise Unsupported(f"the CUDA driver has no {name}") from None
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _driver = lib
    return _driver


def _check(rc: int, what: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(rc, ctypes.byref(text))
        message = f"{what} failed: CUDA error {rc} ({(text.value or b'?').decode()})"
        raise (torch.cuda.OutOfMemoryError if rc == _CUDA_ERROR_OUT_OF_MEMORY else RuntimeError)(message)


def _index(device: torch.device | int) -> int:
    return device if isinstance(device, int) else (device.index if device.index is not None
                                                   else torch.cuda.current_device())


def mapped_bytes(device: torch.device | int | None = None) -> int:
    """Bytes of releasable memory mapped now on `device` (all devices when None)."""
    return sum(_mapped.values()) if device is None else _mapped.get(_index(device), 0)


def set_released_bytes(device: torch.device | int, nbytes: int) -> None:
    """Declare that `nbytes` on `device` that PyTorch counts as allocated have their physical pages back with the
    driver now (another engine's sleep unmapped them under live tensors); 0 once they are mapped again."""
    with _lock:
        _released[_index(device)] = max(0, int(nbytes))


def released_bytes(device: torch.device | int) -> int:
    """What `set_released_bytes` last declared for `device`."""
    return _released.get(_index(device), 0)


class _CudaArray:
    """A `__cuda_array_interface__` over the reserved range, so `torch.as_tensor` views it without a copy; the
    tensor keeps this object, and so the mapping and its reservation, alive."""

    def __init__(self, address: int, nbytes: int, owner: "_Mapping"):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}
        self.owner = owner


class _Mapping:
    """The reserved address range and the physical memory mapped at it; freed by `close()` or when the last tensor
    viewing it (through `_CudaArray`) is gone. It holds no tensor: a tensor keeps its `_CudaArray` from C++, where
    Python's cycle collector cannot see, so a mapping that held its own tensor would never be collected (a process
    training one run after another kept every run's KV caches mapped)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.address: int | None = None
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        lib = _cuda()
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()  # makes the device's primary context current on this thread for the driver API
            self._prop = _AllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED,
                                         location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index))
            granularity = ctypes.c_size_t()
            rc = lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop),
                                                   _CU_MEM_ALLOC_GRANULARITY_MINIMUM)
            if rc != 0:
                raise Unsupported(f"cuMemGetAllocationGranularity returned CUDA error {rc}")
            g = granularity.value
            self.size = (max(nbytes, 1) + g - 1) // g * g
            address = ctypes.c_uint64()
            _check(lib.cuMemAddressReserve(ctypes.byref(address), self.size, 0, 0, 0), "cuMemAddressReserve")
            self.address = address.value
        self.handle: int | None = None

    def restore(self) -> None:
        if self.handle is not None:
            return
        lib = _cuda()
        with torch.cuda.device(self.index):
            handle = ctypes.c_uint64()
            try:
                _check(lib.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0), "cuMemCreate")
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                _check(lib.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0), "cuMemCreate")
            try:
                _check(lib.cuMemMap(self.address, self.size, 0, handle.value, 0), "cuMemMap")
                access = _AccessDesc(location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index),
                                     flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                _check(lib.cuMemSetAccess(self.address, self.size, ctypes.byref(access), 1), "cuMemSetAccess")
            except BaseException:
                lib.cuMemUnmap(self.address, self.size)
                lib.cuMemRelease(handle.value)
                raise
        self.handle = handle.value
        with _lock:
            _mapped[self.index] = _mapped.get(self.index, 0) + self.size

    def release(self) -> None:
        if self.handle is None:
            return
        lib = _cuda()
        with torch.cuda.device(self.index):
            torch.cuda.synchronize()
            _check(lib.cuMemUnmap(self.address, self.size), "cuMemUnmap")
            _check(lib.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None
        with _lock:
            _mapped[self.index] -= self.size

    def close(self) -> None:
        if self.address is None:
            return
        self.release()
        _check(_cuda().cuMemAddressFree(self.address, self.size), "cuMemAddressFree")
        self.address = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit the driver may be gone first
            pass


class ReleasableBuffer:
    """`nbytes` of device memory at a fixed address (`tensor`, uint8) whose physical pages `release()` hands back to
    the driver and `restore()` maps again, with undefined contents. Raises `Unsupported` where it cannot work. The
    memory goes back to the driver at `close()`, or once this object and every view of `tensor` are gone."""

    def __init__(self, nbytes: int, device: torch.device):
        if device.type != "cuda":
            raise Unsupported("releasable memory is a CUDA feature")
        self.device, self.nbytes = device, nbytes
        self._mapping = _Mapping(nbytes, device)
        self.restore()
        self.tensor = torch.as_tensor(_CudaArray(self._mapping.address, nbytes, self._mapping), device=device)

    @property
    def mapped(self) -> bool:
        return self._mapping.handle is not None

    def restore(self) -> None:
        """Map physical memory at the reserved addresses again (contents undefined). If the driver has none left,
        PyTorch's cached free blocks are returned to it first and the mapping is tried once more."""
        self._mapping.restore()

    def release(self) -> None:
        """Hand the physical memory back to the driver, after the work queued on the device is done with it. The
        addresses stay reserved: nothing may touch them until `restore()`."""
        self._mapping.release()

    def close(self) -> None:
        """Release the memory and the address range (no tensor viewing it may be used afterwards)."""
        self._mapping.close()
