"""What a call reads of its layout tensors on the host, kept while they are unchanged.

On a GPU, reading a tensor's values on the host (int(t), t.tolist(), t.cpu()) waits for every
kernel queued before it, and copying host data to the device from pageable memory waits too. A
model hands every layer's attention call the same layout tensors: per-row offsets (left
padding), cu_seqlens (packed documents). So the facts the host needs of them (an offset's
smallest and largest value, the documents' lengths, the kernels' work lists) are kept, keyed by
the tensors' identities and versions (Tensor._version counts in-place writes): the first layer
reads them and the others read nothing (docs/performance.md, "Where a call's host time goes").

CPU tensors are read every call: a read costs nothing there, and a write through .numpy() would
not move the version.
"""
from __future__ import annotations

import weakref

import torch


class HostReads:
    """Facts what(*args) kept while every tensor among args is the same object at the same
    version. The other arguments are part of the key (ints, devices: hashable)."""

    def __init__(self, size: int = 256):
        self.size = size
        self.kept = {}    # key -> (weak references, versions, facts)
        self.reads = 0    # facts made (each a host read, or an upload, on a GPU)

    def read(self, what, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # (an inference tensor, made under torch.inference_mode, has no version counter: its
        # in-place writes cannot be told apart, so it is read every call)
        if not any(reads_wait(t) for t in tensors) or any(t.is_inference() for t in tensors):
            return what(*args)
        key = (what,) + tuple(("tensor", id(a)) if isinstance(a, torch.Tensor) else a for a in args)
        entry = self.kept.get(key)
        if entry is not None and all(ref() is t and version == t._version
                                     for ref, version, t in zip(entry[0], entry[1], tensors)):
            return entry[2]
        facts = what(*args)
        self.reads += 1
        if key not in self.kept and len(self.kept) >= self.size:
            self.kept.clear()
        refs = tuple(weakref.ref(t, lambda _, key=key: self.kept.pop(key, None)) for t in tensors)
        self.kept[key] = (refs, tuple(t._version for t in tensors), facts)
        return facts


def reads_wait(tensor) -> bool:
    """Whether reading the tensor on the host waits for a device queue."""
    return tensor.device.type != "cpu"


HOST_READS = HostReads()


def min_max(value) -> tuple[int, int]:
    """An integer tensor's smallest and largest values (one read)."""
    lo, hi = torch.stack([value.min(), value.max()]).tolist()
    return int(lo), int(hi)


def values(value) -> tuple[int, ...]:
    """An integer tensor's values as Python ints."""
    return tuple(value.tolist())


def int64_on(value, device):
    """The tensor as int64 on device (kept: a copy made once while its source is unchanged)."""
    return value.to(device=device, dtype=torch.int64)
