"""Checks of attention()'s arguments that hold for every prior, and the layout they describe:
shapes, dtypes, devices, offsets (ints or per-row int tensors), key_mask and packed documents
(cu_seqlens). Each error is a ValueError that names the argument and how to fix it."""
from __future__ import annotations

import math
import numbers

import torch

from .host_reads import HOST_READS, int64_on, min_max, values

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BACKENDS = ("auto", "triton", "torch")


def autocast_inputs(q, k, v):
    """q, k, v as the attention takes them under torch.autocast: floating tensors other than
    float64 in the autocast dtype of their device, as scaled_dot_product_attention takes them
    (autocast casts the inputs of torch's own ops, never of a Python function): a model moved
    from SDPA to a prior keeps its mixed precision, and q and k in float32 beside v in bfloat16
    (a float32 rotary table) run instead of failing the shared-dtype check."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v
    device = q.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (q, k, v))


def check_inputs(q, k, v, causal, scale, backend):
    if torch.jit.is_tracing():   # (its tensors stand for sizes: an AttributeError from inside)
        raise RuntimeError("torch.jit.trace is not supported (nor torch.jit.script: torch "
                           "deprecates both); use torch.export.export, or torch.compile, which "
                           "trace bamgen's attention through its custom ops")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, N, D], got {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; use float16, bfloat16, float32 or float64 "
                             f"(float64 on backend='torch')")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head dim {k.shape[3]} but q has {q.shape[3]}")
    if q.shape[3] < 1 or q.shape[3] > 256:
        raise ValueError(f"head dim (q.shape[3]) must be in 1..256, got {q.shape[3]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"the number of query heads (q.shape[1] = {q.shape[1]}) must be a multiple "
                         f"of the number of key/value heads (k.shape[1] = {k.shape[1]})")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    # (0 < scale < inf rather than math.isfinite: a comparison also checks the symbolic float
    # that torch.compile(dynamic=True) makes of a module's constant scale; NaN fails it)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat))
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")


def check_causal(traits, causal, pos_q=None, pos_k=None):
    """A prior declared causal_only (its formulas were checked only where a key is at or before
    its query, d >= 0) attends causally, at token positions: the causal mask then hides every
    key after its query, whatever the offsets. Without it, or with positions as tensors (whose
    order no mask follows), a key could sit after its query, where the prior may be nan."""
    if not traits.causal_only:
        return
    declared = (f"the prior {traits.name!r} declares causal_only: true (its log-prior is "
                f"defined only for keys at or before their query, d = i - j >= 0)")
    if causal is not True:
        raise ValueError(f"causal={causal!r}: {declared}; call it with causal=True, or rebuild "
                         f"it without causal_only if its formula holds for d < 0 too")
    if pos_q is not None or pos_k is not None:
        raise ValueError(f"pos_q, pos_k: {declared}, and with positions as tensors the causal "
                         f"mask follows token order, not the positions, so a key may sit after "
                         f"its query; pass token positions (q_offset, k_offset) instead")


def check_theta(traits, theta):
    """Inside an op: theta holds one column per parameter element of this prior. attention()
    and the module build it so; a program traced with another build of the prior would not
    (the ops' names differ per build, runtime/ops.py: op_name, so this is a last guard, before
    a hook unpacks the columns with an error that names neither)."""
    if theta.dim() != 2 or theta.shape[1] != traits.num_columns:
        names = ", ".join(p.name for p in traits.params) or "none"
        raise ValueError(f"theta: the prior {traits.name!r} takes theta of shape [heads, "
                         f"{traits.num_columns}] (its parameters: {names}), got "
                         f"{tuple(theta.shape)}: the call was made for another prior; pass this "
                         f"prior's parameters")


MAX_POSITION = 2 ** 24   # positions and distances are exact integers in float32 up to here


def check_positions(Nq, Nk, q_lo, q_hi, k_lo, k_hi):
    """Query positions q_offset .. q_offset + Nq - 1, key positions k_offset .. k_offset + Nk - 1
    and every distance between them must lie within +-2**24 (for every batch row: the offsets'
    smallest and largest values q_lo .. q_hi, k_lo .. k_hi)."""
    for name, lo, hi, n in (("q_offset", q_lo, q_hi, Nq), ("k_offset", k_lo, k_hi, Nk)):
        for off in (lo, hi):
            if off < -MAX_POSITION or off + max(n, 1) - 1 > MAX_POSITION:
                raise ValueError(f"{name} = {off}: positions {off} .. {off + max(n, 1) - 1} leave "
                                 f"[-2**24, 2**24], where positions are exact integers in float32")
    if Nq and Nk:
        far = max(abs(q_hi + Nq - 1 - k_lo), abs(k_hi + Nk - 1 - q_lo))
        if far > MAX_POSITION:
            raise ValueError(f"q_offset and k_offset ({q_lo}..{q_hi}, {k_lo}..{k_hi}): distances "
                             f"between queries and keys reach {far}, beyond 2**24, where they are "
                             f"exact integers in float32; bring the offsets closer")


class Layout:
    """What decides which keys a query row sees and at which positions, besides the causal rule,
    checked and normalised by layout(): q_offset, k_offset (ints, or int64 tensors [B] on q's
    device), key_mask (bool [B, Nk] on q's device, or None) and packed documents (cu_seqlens_q,
    cu_seqlens_k: int64 tensors on q's device, or None)."""
    __slots__ = ("q_offset", "k_offset", "key_mask", "cu_seqlens_q", "cu_seqlens_k")

    def __init__(self, q_offset=0, k_offset=0, key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None):
        self.q_offset, self.k_offset, self.key_mask = q_offset, k_offset, key_mask
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k

    @property
    def plain(self):
        """Int offsets, no mask, no documents: one call of the kernels as they always were."""
        return (isinstance(self.q_offset, int) and isinstance(self.k_offset, int)
                and self.key_mask is None and self.cu_seqlens_q is None)

    def masks(self):
        """The keyword arguments the backends take for key_mask and documents."""
        return dict(key_mask=self.key_mask, cu_seqlens_q=self.cu_seqlens_q,
                    cu_seqlens_k=self.cu_seqlens_k)


def offset(name, value, B, device):
    """An offset as an int, or as an int64 tensor [B] on device; with its smallest and largest."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an int or an integer tensor [B], got a {value.dtype} tensor")
        if value.dim() == 0:
            value = int(value)
        elif value.shape != (B,):
            raise ValueError(f"{name} must be an int or an integer tensor of shape [B] = [{B}] (one "
                             f"start position per batch row), got shape {tuple(value.shape)}")
        else:
            # (within host_reads.kept(), a model's layers: read once)
            lo, hi = HOST_READS.read(min_max, value) if B else (0, 0)
            return value.to(device=device, dtype=torch.int64), lo, hi
    number = as_int(value)
    if number is None:
        raise ValueError(f"{name} must be an int or an integer tensor [B], got {value!r}")
    return number, number, number


def as_int(value):
    """An integer scalar as a Python int (a NumPy integer or a Python int), else None (a bool is
    not taken for an offset: True would be read as 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _cu_seqlens(name, value, total, device):
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int32 (or int64) tensor [docs + 1] of cumulative "
                         f"document lengths (FlashAttention's varlen convention), got {value!r}")
    if value.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 or int64 tensor (cumulative document lengths), "
                         f"got {value.dtype}")
    bounds = HOST_READS.read(values, value)   # (within host_reads.kept(): read once)
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths), got {list(bounds)}")
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total} (the size of dim 2), got "
                         f"{bounds[-1]}")
    if value.device == device and value.dtype == torch.int64:
        return value
    # (the copy kept too: the kernels' layout keys its work lists by it)
    return HOST_READS.read(int64_on, value, device)


def layout(q, k, q_offset, k_offset, key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Check and normalise the layout arguments of attention(), naming the wrong one."""
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    q_offset, q_lo, q_hi = offset("q_offset", q_offset, B, q.device)
    k_offset, k_lo, k_hi = offset("k_offset", k_offset, B, q.device)
    check_positions(Nq, Nk, q_lo, q_hi, k_lo, k_hi)
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.shape != (B, Nk):
            raise ValueError(f"key_mask must be a bool tensor of shape [B, Nk] = [{B}, {Nk}] (False: a "
                             f"padding key), got {tuple(key_mask.shape) if isinstance(key_mask, torch.Tensor) else key_mask!r}")
        if key_mask.is_floating_point() or key_mask.is_complex():
            raise ValueError(f"key_mask must be a bool tensor (or integers: 0 for a padding key, "
                             f"nonzero for a real one), got {key_mask.dtype}")
        key_mask = key_mask.to(device=q.device, dtype=torch.bool).contiguous()
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together (packed documents): give both or neither")
    if cu_seqlens_q is not None:
        if B != 1:
            raise ValueError(f"packed documents (cu_seqlens_q/k) take B = 1: the documents lie one after "
                             f"another in dim 2; q has B = {B}")
        if (q_lo, q_hi, k_lo, k_hi) != (0, 0, 0, 0):
            raise ValueError("q_offset and k_offset must be 0 with packed documents: each document's "
                             "tokens are placed from its own start (token positions restart at 0 "
                             "in each; position tensors place them for the prior)")
        cu_seqlens_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, Nq, q.device)
        cu_seqlens_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, Nk, q.device)
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of documents, "
                             f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    return Layout(q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k)


def block_offsets(q, k, q_offset, k_offset):
    """The block API takes int offsets (a block is one slice of keys of every batch row):
    (q_offset, k_offset) as Python ints."""
    offsets = tuple(as_int(off) for off in (q_offset, k_offset))
    for name, off, number in zip(("q_offset", "k_offset"), (q_offset, k_offset), offsets):
        if number is None:
            raise ValueError(f"{name} must be an int in the block API, got {off!r}")
    check_positions(q.shape[2], k.shape[2], offsets[0], offsets[0], offsets[1], offsets[1])
    return offsets
