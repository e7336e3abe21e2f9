"""What a call reads of its layout tensors on the host, kept for the rest of one forward.

On a GPU, reading a tensor's values on the host (int(t), t.tolist(), t.cpu()) waits for every
kernel queued before it, and copying host data to the device from pageable memory waits too. A
model hands every layer's attention call the same layout tensors: per-row offsets (left
padding), cu_seqlens (packed documents). Within kept() (one forward of a model: the Hugging
Face integration enters it around each forward) the facts the host needs of them (an offset's
smallest and largest value, the documents' lengths, the kernels' work lists) are kept, keyed
by the tensors' identities and versions (Tensor._version counts in-place writes): the first
layer reads them and the others read nothing (docs/performance.md, "Where a call's host time
goes"). When the outermost kept() exits, everything is forgotten.

Why a scope, not a cache across calls: some writes move no version. A compiled graph hands a
dead buffer to a new tensor and fills it with its own kernel; .data writes, collectives
(dist.broadcast into a buffer) and DLPack aliases write past the counter. Within one forward of
eager code a layout is not rewritten, and the custom ops' implementations, which compiled
graphs run, read afresh (read_fresh) even inside kept(). Outside kept() every call reads anew, as
do CPU tensors (a read costs nothing there) and inference tensors (no version counter).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref

import torch


class HostReads:
    """Facts what(*args) kept while every tensor among args is the same object at the same
    version. The other arguments are part of the key (ints, devices: hashable)."""

    def __init__(self, size: int = 256):
        self.size = size
        self.kept = {}    # key -> (weak references, versions, facts)
        self.reads = 0    # facts made (each a host read, or an upload, on a GPU's tensors)

    def read(self, what, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # (an inference tensor, made under torch.inference_mode, has no version counter: its
        # in-place writes cannot be told apart, so it is read every call)
        if (_DEPTH.get() == 0 or not any(reads_wait(t) for t in tensors)
                or any(t.is_inference() for t in tensors)):
            self.reads += 1
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

    def forget(self) -> None:
        self.kept.clear()


_DEPTH = contextvars.ContextVar("bamgen_kept_reads", default=0)   # kept() scopes entered


def enter():
    """Enter a kept() scope; returns the token that leave() takes."""
    return _DEPTH.set(_DEPTH.get() + 1)


def leave(token) -> None:
    """Leave a kept() scope; the outermost forgets every fact kept."""
    _DEPTH.reset(token)
    if _DEPTH.get() == 0:
        HOST_READS.forget()


@contextlib.contextmanager
def kept():
    """Keep what the calls within read of their layout tensors (while each tensor is the same
    object at the same version) until the outermost kept() exits: wrap one forward of a model
    whose layers share a layout."""
    token = enter()
    try:
        yield
    finally:
        leave(token)


def read_fresh(fn):
    """fn with every fact read anew, within kept() too: a custom op's implementation, which a
    compiled graph runs on buffers it reuses without moving their versions."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _DEPTH.set(0)
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.reset(token)
    return wrapper


class ReadScope:
    """A model's forward pre-hook and hook that enter and leave kept() around its forward
    (the Hugging Face integration's: every layer of one forward shares its layout). Nothing
    under torch.compile, whose graphs run the ops, which read afresh. Picklable, with no state
    but the open scopes' tokens, which are not kept."""

    def __init__(self):
        self.tokens = []

    def enter(self, module, args):
        if not torch.compiler.is_compiling():
            self.tokens.append(enter())

    def leave(self, module, args, output):
        if not torch.compiler.is_compiling() and self.tokens:
            leave(self.tokens.pop())

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.tokens = []


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
