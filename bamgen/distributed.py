"""Context parallelism: one long sequence split over the ranks of a torch.distributed group.

    from bamgen.distributed import shard, unshard, ring_attention
    q_l, k_l, v_l = (shard(x, group=cp) for x in (q, k, v))     # this rank's part of dim 2
    out_l = ring_attention(mod, q_l, k_l, v_l, causal=True, group=cp, **params)   # mod: generated
    out = unshard(out_l, group=cp)                                # the full [B, H, N, D] everywhere

Layout (`shard`). With W ranks the sequence is cut into 2W equal chunks and rank r holds chunks
r and 2W-1-r (a head and a tail chunk, "zigzag"): under a causal mask every rank then has the
same amount of work at every step, where a plain split would leave the first rank idle.

The ring (`ring_attention`). Step t = 0 .. W-1: rank r attends its queries to the keys and values
of rank src = r - t (mod W), which src sends straight to r, so every step is one permutation of
point-to-point messages (`batch_isend_irecv`). The transfer of step t+1 is posted before step t
is computed, so communication runs under compute. Each (query chunk, key chunk) pair is one call
of the module's block API (`forward_block`) with the chunks' global positions as offsets; the
partial outputs merge exactly by the log-sum-exp rule on the (m, l) statistics. A pair that the
causal mask, or a window of the prior (a log-prior that is -oo beyond some distance), makes
invisible is not computed, and a chunk no pair of the receiver needs is not sent: under a causal
mask rank r needs only the head chunk of a rank src < r, so a quarter of a plain ring's traffic
is never sent.

The backward runs the same schedule again: K/V are sent again (nothing from the forward is kept
but this rank's own output and row statistics), `backward_block` gives each pair's share of dq
(summed on the query's rank), of dk and dv (summed per step and returned straight to the keys'
owner, posted as soon as the step is computed) and of the prior-parameter gradients, which are
summed over the group with one all_reduce so that every rank holds the gradient of the whole
sequence, as a one-process run would.

Before the ring sends anything the ranks agree on the call (one small all_gather): each rank
checks its own shards, then every rank raises if any rank refused or the shards' shapes differ,
so that no rank is left waiting in the ring for a peer that refused (`_agree`); the backward
agrees the same way on its own checks.

Only torch.distributed is used (gloo on CPUs, NCCL on GPUs). docs/distributed.md has the usage,
the rules (what must match on every rank) and what is left.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from .runtime.autograd import first_order, use_triton
from .runtime.checks import MAX_POSITION, autocast_inputs, check_causal, check_inputs
from .runtime.params import param_block, theta as make_theta
from .runtime.positions import Positions, check_integer_distances, given_positions

__all__ = ["shard", "unshard", "ring_attention"]

_KV_TAG, _DKV_TAG, _POS_TAG, _DPOS_TAG = 1, 2, 3, 4   # message tags (gloo matches on them)
_WINDOW_SLICE = 1 << 16           # distances per slice when looking for the prior's window


# --------------------------------------------------------------------------------------------
# the group and the load-balanced layout
# --------------------------------------------------------------------------------------------
def _rank_and_size(group) -> tuple[int, int]:
    """(this rank's index in the group, the group's size); a process that never initialised
    torch.distributed is a group of one (group must then be None)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`; call shard, unshard and "
                         "ring_attention only on the ranks of the context-parallel group")
    return rank, dist.get_world_size(group)


def _chunk_indices(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2 * world) that `rank` holds: a head chunk and a tail chunk."""
    return rank, 2 * world - 1 - rank


def _check_sequence(x, dim: int, world: int) -> int:
    """The chunk length of `x`'s sequence dimension split over `world` ranks."""
    if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"x must be a tensor with the sequence in dim {dim}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    n = x.shape[dim]
    if n == 0 or n % (2 * world):
        raise ValueError(f"x has {n} positions in dim {dim}; over {world} rank(s) the sequence must "
                         f"be a positive multiple of 2 * {world} = {2 * world} (each rank holds a head "
                         f"and a tail chunk): pad it at its end (under a causal mask no real token "
                         f"sees the padding)")
    return n // (2 * world)


def _local_part(x, rank: int, world: int, chunk: int, dim: int):
    head, tail = _chunk_indices(rank, world)
    return torch.cat([x.narrow(dim, head * chunk, chunk), x.narrow(dim, tail * chunk, chunk)], dim=dim)


def shard(x, group=None, dim=2):
    """This rank's part of the sequence dimension of `x` (the whole sequence, the same on every
    rank; dim 2 of [B, H, N, D], or another `dim`, e.g. 1 for token ids [B, N]): chunks r and
    2W-1-r of 2W equal chunks, concatenated (load-balanced for a causal mask). Differentiable.
    N must be a multiple of 2W."""
    rank, world = _rank_and_size(group)
    chunk = _check_sequence(x, dim, world)
    return _local_part(x, rank, world, chunk, dim)


class _Unshard(torch.autograd.Function):
    """all_gather of the shards, put back in sequence order. Every rank holds the same full
    tensor, so a loss computed from it on every rank is one loss: the gradient of this rank's
    shard is its own part of the incoming gradient (not a sum over ranks)."""

    @staticmethod
    def forward(ctx, x, group, rank, world, dim):
        chunk = x.shape[dim] // 2
        ctx.layout = (rank, world, chunk, dim)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        chunks = [None] * (2 * world)
        for r, part in enumerate(parts):
            head, tail = _chunk_indices(r, world)
            chunks[head], chunks[tail] = part.narrow(dim, 0, chunk), part.narrow(dim, chunk, chunk)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return _local_part(grad, *ctx.layout), None, None, None, None


def unshard(x, group=None, dim=2):
    """The full sequence from every rank's shard (the inverse of `shard`), on every rank.
    Differentiable: the gradient of this rank's shard is its part of the full gradient."""
    rank, world = _rank_and_size(group)
    if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim() or x.shape[dim] % 2:
        raise ValueError(f"x must be a shard from `shard` (an even length in dim {dim}), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if world == 1:
        return x
    return _Unshard.apply(x, group, rank, world, dim % x.dim())


# --------------------------------------------------------------------------------------------
# what the prior needs from the ring
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RingTraits:
    """What the ring must know about a prior, from its module's TRAITS (bamgen.runtime.traits).

    uses_n: the logit uses n (the number of keys the query sees): every block is given the
        count over the whole row (the block API's `n`), not over its own keys.
    window: the log-prior can be -oo (a window), or the file sets skip_below, and the logit is
        s + f(d), so a (query chunk, key chunk) pair whose every distance is outside the window
        (or below the bound) can be skipped; the ring finds those pairs by evaluating the
        log-prior per distance.
    skip_below: the file's skip_below (nats below the head's largest log-prior), else None."""
    uses_n: bool
    window: bool
    skip_below: Optional[float] = None


def _traits(mod) -> _RingTraits:
    traits = mod.TRAITS
    skip_below = traits.skip_below if traits.table_path else None
    return _RingTraits(uses_n=traits.uses_n,
                       window=traits.table_path and (traits.window or skip_below is not None),
                       skip_below=skip_below)


# --------------------------------------------------------------------------------------------
# the schedule: which (query chunk, key chunk) pairs each step computes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ring:
    """The context-parallel group and the pairs of chunks that can see each other.

    Chunk x covers positions [x * chunk, (x + 1) * chunk); rank r holds chunks (r, 2W-1-r) as
    its local slots 0 (head) and 1 (tail). `distances` is the set of chunk distances
    qx - kx at which some score is visible (None: all of them); `docs`, packed documents (None:
    one sequence)."""
    group: object
    rank: int
    world: int
    chunk: int
    causal: bool
    distances: Optional[frozenset]
    docs: Optional["_Documents"] = None

    def start(self, rank: int, slot: int) -> int:
        return _chunk_indices(rank, self.world)[slot] * self.chunk

    def pairs(self, q_rank: int, k_rank: int) -> list[tuple[int, int]]:
        """(query slot, key slot) pairs of q_rank's queries and k_rank's keys with a visible score."""
        out = []
        for qs, qx in enumerate(_chunk_indices(q_rank, self.world)):
            for ks, kx in enumerate(_chunk_indices(k_rank, self.world)):
                if self.causal and kx > qx:
                    continue
                if self.distances is not None and qx - kx not in self.distances:
                    continue
                if self.docs is not None and not self.docs.segments(
                        qx * self.chunk, kx * self.chunk, self.chunk, self.causal):
                    continue
                out.append((qs, ks))
        return out

    def needed(self, q_rank: int, k_rank: int) -> tuple[int, ...]:
        """The key slots of k_rank that q_rank needs, in slot order."""
        return tuple(sorted({ks for _, ks in self.pairs(q_rank, k_rank)}))

    def peer(self, rank: int) -> int:
        """The global rank (what P2POp takes) of a rank of the group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


@dataclass(frozen=True)
class _Segment:
    """One document's part of a (query chunk, key chunk) pair: rows [q_lo, q_hi) of the query
    chunk and keys [k_lo, k_hi) of the key chunk (chunk-local), positions counted from the
    document's start (q_offset, k_offset), doc_len its length."""
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    q_offset: int
    k_offset: int
    doc_len: int


@dataclass(frozen=True)
class _Documents:
    """Packed documents of the whole sequence (FlashAttention's cu_seqlens): a query sees only
    keys of its own document, and positions restart at each document's start, as in
    `mod.attention(..., cu_seqlens_q=cu, cu_seqlens_k=cu)` on one process."""
    bounds: tuple          # (start, end) of each non-empty document, in order

    def segments(self, q_start: int, k_start: int, chunk: int, causal: bool) -> list:
        """The documents that have rows in [q_start, q_start + chunk) and keys they can see in
        [k_start, k_start + chunk), each as a _Segment (under a causal mask, keys past the last
        row are cut off). Only the documents that meet the query chunk are looked at (the
        schedule asks this for every pair at every step; there may be thousands of documents)."""
        out = []
        first = bisect.bisect_right(self.bounds, (q_start, math.inf))   # past the docs starting <= q_start
        for index in range(max(0, first - 1), len(self.bounds)):
            start, end = self.bounds[index]
            if start >= q_start + chunk:
                break
            q_lo, q_hi = max(start, q_start), min(end, q_start + chunk)
            k_lo, k_hi = max(start, k_start), min(end, k_start + chunk)
            if causal:
                k_hi = min(k_hi, q_hi)
            if q_lo < q_hi and k_lo < k_hi:
                out.append(_Segment(q_lo - q_start, q_hi - q_start, k_lo - k_start, k_hi - k_start,
                                    q_lo - start, k_lo - start, end - start))
        return out


def _documents(cu_seqlens, total: int) -> tuple[list, _Documents]:
    """Check cu_seqlens (int [docs + 1], 0 .. total, non-decreasing) and read it once: its bounds
    (which the agreement compares between ranks: they must agree on what is sent) and the
    documents."""
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor [docs + 1] of the whole "
                         f"sequence's document bounds (0, ..., {total}), got "
                         f"{tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens!r}")
    cuts = [int(c) for c in cu_seqlens.tolist()]
    if cuts[0] != 0 or cuts[-1] != total or any(b < a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the whole "
                         f"sequence's length {total} (2 * world * chunk; a padding tail is a "
                         f"document of its own), got {cuts[:4]}{' ...' if len(cuts) > 4 else ''}")
    return cuts, _Documents(tuple((a, b) for a, b in zip(cuts, cuts[1:]) if b > a))


class _Window:
    """A prior that is -oo beyond some distances (a window), depending on positions through d
    alone: its log-prior per distance and head (the module's `log_prior_at`) with this call's
    parameter values. With skip_below, a distance whose log-prior is more than skip_below nats
    under the head's largest over the sequence counts as hidden too, as the GPU kernels' block
    skipping reads it (an approximation: such a score has at most exp(-skip_below) times the
    weight of the head's best distance)."""

    def __init__(self, mod, params, hq, device, skip_below=None):
        self.mod, self.hq, self.params = mod, hq, params
        self.device = device
        self.skip_below = skip_below
        self.floor = None      # per head: the largest log-prior minus skip_below (chunk_distances)

    def _log_prior(self, d0: int, d1: int):
        pos_d = torch.arange(d0, d1, device=self.device)
        # (the module's Prior: its log_prior_at() may have renamed num_heads for a parameter)
        return pos_d, self.mod._prior.log_prior_at(pos_d, dict(self.params), self.hq)

    def visible(self, d0: int, d1: int, causal: bool):
        """bool [Hq, d1 - d0]: whether distance d0 .. d1 - 1 lets a score through (NaN counts
        as visible: nothing is hidden that the module would compute)."""
        pos_d, lp = self._log_prior(d0, d1)
        ok = lp != -math.inf
        if self.floor is not None:
            ok &= ~(lp < self.floor[:, None])
        return ok & (pos_d >= 0)[None] if causal else ok

    def _floor(self, lo: int, n: int):
        """Per head, the largest finite log-prior over distances [lo, n) minus skip_below."""
        best = torch.full((self.hq,), -math.inf, dtype=torch.float64, device=self.device)
        for d0 in range(lo, n, _WINDOW_SLICE):
            _, lp = self._log_prior(d0, min(n, d0 + _WINDOW_SLICE))
            best = torch.maximum(best, torch.where(torch.isfinite(lp), lp, -math.inf).amax(1))
        return best - self.skip_below

    def chunk_distances(self, chunk: int, world: int, causal: bool, span: int) -> frozenset:
        """Chunk distances qx - kx at which some score is visible (the distances evaluated in
        slices, so memory stays small for a long sequence). span: the most keys a query can
        see (the sequence's length, or the longest packed document's): skip_below is measured
        from the best log-prior over those distances."""
        n = 2 * world * chunk
        lo = 0 if causal else -(n - 1)
        if self.skip_below is not None:
            self.floor = self._floor(0 if causal else -(span - 1), span)
        seen = torch.cat([self.visible(d0, min(n, d0 + _WINDOW_SLICE), causal).any(0)
                          for d0 in range(lo, n, _WINDOW_SLICE)])
        count = torch.cumsum(seen.to(torch.int64), 0).tolist()

        def any_between(a, b):   # any visible distance in [a, b]
            a, b = max(a, lo), min(b, n - 1)
            return a <= b and count[b - lo] - (count[a - lo - 1] if a > lo else 0) > 0

        return frozenset(delta for delta in range(-(2 * world - 1), 2 * world)
                         if any_between(delta * chunk - (chunk - 1), delta * chunk + (chunk - 1)))


# --------------------------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------------------------
def _pack(k, v, chunk):
    """[slot, k|v, B, Hk, chunk, D]: this rank's two chunks of K and V, each slot contiguous, so
    that one slot or both can be sent as they are."""
    return torch.stack([torch.stack([k[:, :, :chunk], v[:, :, :chunk]]),
                        torch.stack([k[:, :, chunk:], v[:, :, chunk:]])])


class _Transfer:
    """One step's messages in flight: what this rank receives, once waited for."""

    def __init__(self, works, received, keep):
        self.works, self.received, self._keep = works, received, keep

    def wait(self):
        for work in self.works:
            work.wait()
        self._keep = None
        return self.received


def _exchange(ring: _Ring, send, send_to, recv_shape, recv_from, dtype, device, tag) -> _Transfer:
    """Post one send and one receive (either may be None) as one batch."""
    ops, received = [], None
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, ring.peer(send_to), ring.group, tag))
    if recv_shape is not None:
        received = torch.empty(recv_shape, dtype=dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, received, ring.peer(recv_from), ring.group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    return _Transfer(works, received, send)


def _post_kv(ring: _Ring, own, step: int, tag=_KV_TAG) -> tuple[_Transfer, tuple[int, ...]]:
    """Step `step`'s K/V (or, tag _POS_TAG, the keys' positions): send this rank's chunks that
    rank + step needs, receive the chunks of rank - step that this rank needs. Returns the
    transfer and the received slots."""
    dst, src = (ring.rank + step) % ring.world, (ring.rank - step) % ring.world
    give, take = ring.needed(dst, ring.rank), ring.needed(ring.rank, src)
    send = None if not give else (own if give == (0, 1) else own[give[0]])
    shape = None if not take else (len(take), *own.shape[1:])
    return _exchange(ring, send, dst, shape, src, own.dtype, own.device, tag), take


# --------------------------------------------------------------------------------------------
# the row statistics
# --------------------------------------------------------------------------------------------
class _Rows:
    """Running output and (m, l) statistics of this rank's query rows over the blocks seen so
    far, in place in tensors of the whole shard; `merge` adds one block of one chunk."""

    def __init__(self, q, chunk):
        self.out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self.m = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        self.l = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
        self.chunk = chunk

    def merge(self, slot, out_b, stats_b, lo=0, hi=None):
        """The log-sum-exp rule in base 2 with the exact row max (docs/architecture.md), over
        rows [lo, hi) of the slot's chunk (a document's part of it; default all)."""
        base = slot * self.chunk
        rows = slice(base + lo, base + (self.chunk if hi is None else hi))
        out, m_old, l_old = self.out[:, :, rows], self.m[:, :, rows], self.l[:, :, rows]
        m_b, l_b = stats_b[..., 0], stats_b[..., 1]
        m = torch.maximum(m_old, m_b)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w_old = l_old * torch.exp2(m_old - m_safe)
        w_b = l_b * torch.exp2(m_b - m_safe)
        l = w_old + w_b
        norm = torch.where(l == 0, torch.ones_like(l), l)
        out.mul_((w_old / norm)[..., None]).add_(out_b.mul_((w_b / norm)[..., None]))
        m_old.copy_(m)
        l_old.copy_(l)

    def stats(self):
        return torch.stack([self.m, self.l], dim=-1)


# --------------------------------------------------------------------------------------------
# forward and backward over the ring
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Call:
    """How each block is computed: the module, its settings and the prior's parameter values."""
    mod: object
    causal: bool
    scale: Optional[float]
    backend: str
    n_total: Optional[int]     # the sequence length, for a prior that uses n (else None)
    window: Optional[_Window]  # for a prior with a window (else None)

    def blocks(self, ring: _Ring, q_rank, q_slot, k_rank, k_slot) -> list:
        """The block calls of one (query chunk, key chunk) pair: (rows, keys, kwargs), rows and
        keys slices of the chunks. One call over the whole chunks, or with packed documents one
        per document the pair shares, with the document's own positions."""
        q_start, k_start = ring.start(q_rank, q_slot), ring.start(k_rank, k_slot)
        base = dict(causal=self.causal, scale=self.scale, backend=self.backend)
        if ring.docs is None:
            rows = torch.arange(q_start, q_start + ring.chunk)
            return [(slice(0, ring.chunk), slice(0, ring.chunk),
                     dict(base, q_offset=q_start, k_offset=k_start, **self._n(rows, self.n_total)))]
        out = []
        for seg in ring.docs.segments(q_start, k_start, ring.chunk, self.causal):
            rows = torch.arange(seg.q_offset, seg.q_offset + seg.q_hi - seg.q_lo)
            out.append((slice(seg.q_lo, seg.q_hi), slice(seg.k_lo, seg.k_hi),
                        dict(base, q_offset=seg.q_offset, k_offset=seg.k_offset,
                             **self._n(rows, seg.doc_len))))
        return out

    def _n(self, rows, length) -> dict:
        """For a prior that uses n: the count over the whole row (all blocks), rows being the
        queries' positions in a sequence (or document) of `length` keys."""
        if self.n_total is None:
            return {}
        return {"n": (rows + 1).clamp(0, length) if self.causal else torch.full_like(rows, length)}

    def forward(self, ring: _Ring, rows: _Rows, q, kv, params, q_slot, k_rank, k_slot, q_pos=None):
        """Merge into `rows` this rank's query chunk q_slot against one key chunk (kv: its K, V
        and, with positions, the keys' positions; q_pos: the query chunk's positions)."""
        for r, c, kw in self.blocks(ring, ring.rank, q_slot, k_rank, k_slot):
            out_b, stats_b = self.mod.forward_block(q[:, :, r], kv[0][:, :, c], kv[1][:, :, c],
                                                    **params, **kw, **_block_pos(q_pos, kv, r, c))
            rows.merge(q_slot, out_b, stats_b, r.start, r.stop)


def _block_pos(q_pos, kv, rows, keys) -> dict:
    """The block call's pos_q and pos_k ({} without positions): rows of the query chunk's
    positions, keys of the key chunk's (kv[2])."""
    if q_pos is None:
        return {}
    return dict(pos_q=q_pos[:, :, rows], pos_k=kv[2][:, :, keys])


def _split(x):
    half = x.shape[2] // 2
    return x[:, :, :half], x[:, :, half:]


def _steps(ring: _Ring, k, v, k_pos=None):
    """Yield (step, source rank, {slot: (k chunk, v chunk)}) with the next step's K/V already in
    flight while the caller computes on the current one; with the keys' positions k_pos
    [B, Hq, 2c, C], each slot's tuple holds its chunk of them third (sent beside K/V)."""
    c = ring.chunk
    own = _pack(k, v, c) if ring.world > 1 else None     # what is sent: contiguous chunks
    own_pos = None
    if k_pos is not None and ring.world > 1:
        own_pos = torch.stack([k_pos[:, :, :c], k_pos[:, :, c:]]).contiguous()

    def post(step):
        if step >= ring.world:
            return None
        return (_post_kv(ring, own, step),
                None if own_pos is None else _post_kv(ring, own_pos, step, _POS_TAG))
    pending = post(1) if ring.world > 1 else None
    for step in range(ring.world):
        if step == 0:
            kv = {s: (k[:, :, s * c:(s + 1) * c], v[:, :, s * c:(s + 1) * c])
                  + (() if k_pos is None else (k_pos[:, :, s * c:(s + 1) * c],)) for s in (0, 1)}
        else:
            (transfer, slots), pos_transfer = pending
            buffer = transfer.wait()
            kv = {s: (buffer[i, 0], buffer[i, 1]) for i, s in enumerate(slots)}
            if pos_transfer is not None:
                positions = pos_transfer[0].wait()
                kv = {s: kv[s] + (positions[i],) for i, s in enumerate(slots)}
            pending = post(step + 1)
        yield step, (ring.rank - step) % ring.world, kv


def _ring_forward(ring: _Ring, call: _Call, q, k, v, params, pos=None):
    """(out float32 [B, Hq, 2 * chunk, D], stats [B, Hq, 2 * chunk, 2]) of this rank's queries.
    pos: this rank's (pos_q, pos_k) shards [B, Hq, 2 * chunk, C], or None."""
    queries = _split(q)
    q_pos = (None, None) if pos is None else _split(pos[0])
    rows = _Rows(q, ring.chunk)
    for _step, src, kv in _steps(ring, k, v, None if pos is None else pos[1]):
        for qs, ks in ring.pairs(ring.rank, src):
            call.forward(ring, rows, queries[qs], kv[ks], params, qs, src, ks, q_pos[qs])
    return rows.out, rows.stats()


def _ring_backward(ring: _Ring, call: _Call, dout, q, k, v, out, stats, params, pos=None):
    """dq, dk, dv of this rank's shards, the learnable parameters' gradients of this rank's
    query rows ({name: [Hq]}, not yet summed over the group) and, with positions, (dpos_q,
    dpos_k) of this rank's position shards (else None)."""
    mod = call.mod
    queries, douts, outs, row_stats = _split(q), _split(dout), _split(out), _split(stats)
    q_pos = (None, None) if pos is None else _split(pos[0])
    dpos = None if pos is None else [torch.zeros(p.shape, dtype=torch.float64, device=p.device)
                                     for p in pos]
    dpos_slots = None if pos is None else list(_split(dpos[1]))
    returning_pos = None
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_parts = _split(dq)
    d_own = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)   # [dk|dv, B, Hk, 2c, D]
    d_slots = [d_own[:, :, :, :ring.chunk], d_own[:, :, :, ring.chunk:]]       # [dk|dv, B, Hk, c, D]
    dparams = None
    row_sums = torch.zeros(*q.shape[:3], 1 + mod.TRAITS.num_grads, dtype=torch.float32,
                           device=q.device)
    row_parts = _split(row_sums)
    returning = None     # the previous step's dK/dV on its way back to their owner
    chunk_shape = (2, *k.shape[:2], ring.chunk, k.shape[3])                   # [k|v, B, Hk, c, D]
    for step, src, kv in _steps(ring, k, v, None if pos is None else pos[1]):
        if step == 0:
            d_kv, d_pos = d_slots, dpos_slots
        else:
            d_kv = torch.zeros((len(kv), *chunk_shape), dtype=torch.float32, device=k.device)
            d_pos = None if pos is None else torch.zeros(
                (len(kv), *pos[1].shape[:2], ring.chunk, pos[1].shape[3]), dtype=torch.float64,
                device=k.device)
        place = {s: i for i, s in enumerate(kv)}     # received slot -> index in d_kv
        for qs, ks in ring.pairs(ring.rank, src):
            for r, c, kw in call.blocks(ring, ring.rank, qs, src, ks):
                dq_b, dk_b, dv_b, dp_b, rows_b, *dpos_b = mod.backward_block(
                    douts[qs][:, :, r], queries[qs][:, :, r], kv[ks][0][:, :, c], kv[ks][1][:, :, c],
                    outs[qs][:, :, r], row_stats[qs][:, :, r], **params, **kw,
                    **_block_pos(q_pos[qs], kv[ks], r, c))
                dq_parts[qs][:, :, r].add_(dq_b)
                d_kv[place[ks]][0][:, :, c].add_(dk_b)
                d_kv[place[ks]][1][:, :, c].add_(dv_b)
                row_parts[qs][:, :, r].add_(rows_b)
                if dpos_b:
                    _split(dpos[0])[qs][:, :, r].add_(dpos_b[0])
                    d_pos[place[ks]][:, :, c].add_(dpos_b[1])
                if dparams is None:
                    dparams = {name: torch.zeros_like(g, dtype=torch.float32) for name, g in dp_b.items()}
                for name in mod.LEARNABLE:
                    dparams[name] += dp_b[name]
        if step > 0:
            sent_back = _return_dkv(ring, d_kv, step)
            if returning is not None:
                _add_returned(returning, d_slots)
            returning = sent_back
            if pos is not None:   # the keys' positions' gradients go home beside dK/dV
                sent_pos = _return_dkv(ring, d_pos, step, _DPOS_TAG)
                if returning_pos is not None:
                    _add_returned(returning_pos, dpos_slots)
                returning_pos = sent_pos
    if returning is not None:
        _add_returned(returning, d_slots)
    if returning_pos is not None:
        _add_returned(returning_pos, dpos_slots)
    if dparams is None:   # (no block on this rank: nothing to add)
        dparams = {name: torch.zeros(q.shape[1], *learned_shape(mod.TRAITS, name), device=q.device)
                   for name in mod.LEARNABLE}
    grads = mod.finish_param_grads(dparams, row_sums) if mod.LEARNABLE else {}
    dpos = None if pos is None else tuple(d.to(p.dtype) for d, p in zip(dpos, pos))
    return dq.to(q.dtype), d_own[0].to(k.dtype), d_own[1].to(v.dtype), grads, dpos


def learned_shape(traits, name):
    """A learnable parameter's gradient shape beyond the heads: () or (size,)."""
    size = traits.param(name).size
    return () if size is None else (size,)


def _return_dkv(ring: _Ring, d_kv, step: int, tag=_DKV_TAG):
    """Send step `step`'s dK/dV (of rank - step's chunks; tag _DPOS_TAG: their positions'
    gradients) back to their owner and receive what rank + step computed for this rank's
    chunks."""
    dst, src = (ring.rank + step) % ring.world, (ring.rank - step) % ring.world
    mine = ring.needed(dst, ring.rank)       # what dst received from this rank, so computed on
    shape = None if not mine else (len(mine), *d_kv.shape[1:])
    sent = d_kv if ring.needed(ring.rank, src) else None
    return _exchange(ring, sent, src, shape, dst, d_kv.dtype, d_kv.device, tag), mine


def _add_returned(returning, d_slots):
    transfer, slots = returning
    received = transfer.wait()
    for i, s in enumerate(slots):
        d_slots[s].add_(received[i])


class _RingAttention(torch.autograd.Function):
    """Autograd over the ring: q, k, v shards and `learned` [Hq, learnable scalars] (the
    learnable parameters' values as columns, a vector's elements side by side; their gradient
    flows back to whatever tensors the caller passed, through the concatenation that made them)."""

    @staticmethod
    def forward(ctx, ring, call, fixed, q, k, v, learned, pos_q=None, pos_k=None):
        params = _block_params(call.mod, fixed, learned)
        pos = None if pos_q is None else (pos_q.detach(), pos_k.detach())
        out, stats = _ring_forward(ring, call, q, k, v, params, pos)
        ctx.save_for_backward(q, k, v, learned, out, stats, *(pos or ()))
        ctx.ring, ctx.call, ctx.fixed = ring, call, fixed
        return out.to(q.dtype)

    @staticmethod
    @first_order   # (a second derivative raises, as the one-process attention's does)
    def backward(ctx, dout):
        ring, call = ctx.ring, ctx.call
        try:
            q, k, v, learned, out, stats, *pos = ctx.saved_tensors
            params = _block_params(call.mod, ctx.fixed, learned)
            # (again: a fixed parameter passed as a tensor may have been written since the
            # forward, on some ranks only; autograd refuses a saved tensor written since)
            _check_blocks(call.mod, q, k, v, call.causal, call.scale, call.backend, params)
            refusal = None
        except Exception as err:
            refusal = err
        _agree(ring.group, ring.world, None if refusal else [0], refusal, 1, "this call's backward",
               dout.device)
        dq, dk, dv, grads, dpos = _ring_backward(ring, call, dout, q, k, v, out, stats, params,
                                                 tuple(pos) or None)
        dlearned = None
        if ctx.needs_input_grad[6] and call.mod.LEARNABLE:
            dlearned = torch.cat([grads[name].reshape(grads[name].shape[0], -1)
                                  for name in call.mod.LEARNABLE], dim=1).contiguous()
            if ring.world > 1:
                dist.all_reduce(dlearned, group=ring.group)
        return (None, None, None, dq, dk, dv, dlearned) + (tuple(dpos) if dpos else (None, None))


def _block_params(mod, fixed, learned):
    """{name: value} for the block API: the learnable columns of `learned` (detached: [Hq] for a
    scalar, [Hq, size] for a vector) and the fixed (non-learnable) values as given."""
    params = dict(fixed)
    traits = mod.TRAITS
    at = 0
    for name in mod.LEARNABLE:
        size = traits.param(name).size
        params[name] = (learned[:, at] if size is None else learned[:, at:at + size]).detach()
        at += size or 1
    return params


# --------------------------------------------------------------------------------------------
# the agreement: every rank raises, or none does
# --------------------------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SAME_SHAPE = "every rank passes shards of the same shape (bamgen.distributed.shard)"
# A rank's row of the agreement, int64 columns: 0 a refusal, then what every rank must hold
# alike (the columns, how to say it, how a value reads, the rule), then its integer positions'
# extent and its window's visible chunk distances.
_ALIKE = (
    (slice(1, 5), "q's shard is", list, _SAME_SHAPE),
    (slice(5, 9), "k's shard (and v's) is", list, _SAME_SHAPE),
    (slice(9, 10), "q, k and v are", lambda c: str(_DTYPES[c[0]]),
     "every rank passes them in one dtype (under torch.autocast: the same autocast dtype)"),
    (slice(10, 11), "causal is", lambda c: str(bool(c[0])), "every rank makes the same call"),
    (slice(11, 12), "pos_q and pos_k are", lambda c: f"given ({c[0]} channel(s))" if c[0] else "not given",
     "every rank passes its shards of them, or none does"),
    (slice(12, 14), "cu_seqlens is", lambda c: f"[{c[0]} bounds, checksum {c[1]}]" if c[0] else "not given",
     "every rank passes the whole sequence's document bounds, the same on every rank"),
    (slice(14, 15), "the gradients wanted are", lambda c: _GRADIENTS[c[0]],
     "every rank runs the backward and sums the parameters' gradients alike: the same tensors "
     "require grad, and torch.no_grad() is on every rank or none"),
)
# column 14: 0 where no backward will run, 1 where it will and sums no parameter's gradient,
# 2 where it sums the prior parameters' gradients over the group (its one collective beside
# the ring's): which of q, k, v want theirs may differ between ranks
_GRADIENTS = ("none", "of q, k, v (or positions) alone", "of the prior's parameters")
_EXTENT = 15        # 1 where both positions are integers, then q_lo, q_hi, k_lo, k_hi
_FLAGS = 20         # a column per chunk distance -(2W-1) .. 2W-1: 1 where the window shows it


def _row_width(world: int) -> int:
    return _FLAGS + 2 * (2 * world - 1) + 1


@dataclass(frozen=True)
class _Plan:
    """This rank's call, checked on its own shards before anything is sent: what the ring runs
    once the ranks agree on it. distances: the chunk distances this rank's window shows (None
    without a window)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos: Optional[Positions]
    learned: torch.Tensor
    fixed: dict
    uses_n: bool
    cuts: Optional[list] = None
    docs: Optional[_Documents] = None
    window: Optional[_Window] = None
    distances: Optional[frozenset] = None

    def row(self, causal: bool, world: int) -> list:
        """This rank's row of the agreement (the layout of _ALIKE, _EXTENT and _FLAGS)."""
        digest = [0, 0] if self.cuts is None else [
            len(self.cuts), sum((i + 1) * c for i, c in enumerate(self.cuts)) % (1 << 61)]
        extent = None if self.pos is None else self.pos.extent
        span = 2 * world - 1
        flags = [0] * (2 * span + 1)
        for delta in self.distances or ():
            flags[delta + span] = 1
        return [0, *self.q.shape, *self.k.shape, _DTYPES.index(self.q.dtype), int(causal),
                0 if self.pos is None else self.pos.channels, *digest, self.gradients(),
                *((0,) * 5 if extent is None else (1, *extent)), *flags]

    def gradients(self) -> int:
        """Column 14 of the row: which gradients this rank's backward computes and sums (a rank
        whose backward does not run, or sums nothing, leaves the others waiting in theirs)."""
        if not torch.is_grad_enabled():
            return 0
        tensors = (self.q, self.k, self.v) + (() if self.pos is None else (self.pos.q, self.pos.k))
        if self.learned.requires_grad:
            return 2
        return int(any(t.requires_grad for t in tensors))


def _agreement_device(group, device):
    """NCCL gathers CUDA tensors only: on the call's own device (q's), else the one
    torch.cuda.set_device chose; every other backend, gloo beside NCCL included, takes the
    agreement's CPU tensor."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _agree(group, world: int, row, refusal, width: int, what: str, device=None) -> list:
    """Every rank's row (`width` ints), gathered in one small collective before the ring sends
    anything. A refusal on any rank (row None, `refusal` its exception) is raised on every rank,
    the refusing rank's own and the others' naming it: a refusal on some ranks only left the
    others waiting in the ring (NCCL hangs, gloo times out) and broke the group's next call."""
    mine = [1] + [0] * (width - 1) if row is None else row
    if world == 1:
        rows = [mine]
    else:
        device = _agreement_device(group, device)
        parts = [torch.empty(width, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(parts, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
        rows = torch.stack(parts).tolist()
    refused = [r for r in range(world) if rows[r][0]]
    if refused:
        _raise_refusal(group, world, refused, refusal, what)
    return rows


def _raise_refusal(group, world: int, refused: list, refusal, what: str):
    """The refusing rank raises its own exception, every other rank a ValueError that names the
    first refusing rank and quotes its message (shared by a second collective, on this path
    only)."""
    said = None if refusal is None else (
        str(refusal) if isinstance(refusal, ValueError) else f"{type(refusal).__name__}: {refusal}")
    messages = [said] * world
    if world > 1:
        dist.all_gather_object(messages, said, group=group)
    if refusal is not None:
        raise refusal
    others = f" (ranks {', '.join(map(str, refused))} refused it)" if len(refused) > 1 else ""
    raise ValueError(f"{_rank_name(group, refused[0])} refused {what}{others}: "
                     f"{messages[refused[0]]}")


def _rank_name(group, rank: int) -> str:
    """'rank 1' (its index in `group`), with its global rank where that differs: the rank a
    user finds in their logs."""
    whole = rank if group is None else dist.get_global_rank(group, rank)
    return f"rank {rank}" + ("" if whole == rank else f" (global rank {whole})")


def _check_alike(rows: list, group):
    """A ValueError, the same on every rank (each holds every row), where a rank's shapes or
    settings differ from rank 0's: the ring would pair messages of different sizes."""
    for columns, what, show, rule in _ALIKE:
        first = rows[0][columns]
        for rank, row in enumerate(rows):
            if row[columns] != first:
                raise ValueError(f"{what} {show(first)} on {_rank_name(group, 0)} but "
                                 f"{show(row[columns])} on {_rank_name(group, rank)}: {rule}")


def _agreed_extent(rows: list):
    """Integer positions' (q_lo, q_hi, k_lo, k_hi) over every rank's shards (the whole
    sequence, as attention() reads it), or None."""
    given = [row[_EXTENT + 1:_EXTENT + 5] for row in rows if row[_EXTENT]]
    if not given:
        return None
    q_lo, q_hi, k_lo, k_hi = zip(*given)
    return min(q_lo), max(q_hi), min(k_lo), max(k_hi)


def _agreed_distances(rows: list, world: int) -> frozenset:
    """The union of every rank's visible chunk distances: parameters that differ by rounding
    between ranks cannot make one rank wait for a message that is never sent."""
    span = 2 * world - 1
    return frozenset(i - span for i in range(2 * span + 1) if any(row[_FLAGS + i] for row in rows))


# --------------------------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------------------------
def _check_module(mod):
    needed = ("forward_block", "backward_block", "finish_param_grads", "log_prior_at", "PARAM_NAMES",
              "LEARNABLE", "PRIOR", "TRAITS")
    missing = [name for name in needed if not hasattr(mod, name)]
    if isinstance(mod, torch.nn.Module):
        raise ValueError("mod must be the generated module (e.g. generated.generalized_gaussian), not "
                         "its nn.Module; pass the layer's parameters as **layer.prior_params()")
    if missing:
        raise ValueError(f"mod must be a module generated by bamgen with the block API; "
                         f"{getattr(mod, '__name__', type(mod).__name__)} lacks {', '.join(missing)} "
                         f"(rebuild it with this bamgen: bamgen build PRIOR.yaml)")


def _check_shards(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be this rank's shard [B, H, 2 * chunk, D] (from shard), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[2] % 2 or q.shape[2] == 0:
        raise ValueError(f"q and k must be shards of one sequence (the same, even length in dim 2), got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B and D")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of query heads ({q.shape[1]}) must be a multiple of the number "
                         f"of key/value heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must share a dtype and a device")


# attention()'s arguments the ring does not take, and what to do instead (docs/distributed.md)
NOT_TAKEN = {
    "key_mask": "pad N to a multiple of 2 x the group's size with a document of its own "
                "(cu_seqlens), which no real token sees",
    "q_offset": "the shards' positions are the whole sequence's, 0 .. N-1",
    "k_offset": "the shards' positions are the whole sequence's, 0 .. N-1",
    "cu_seqlens_q": "pass cu_seqlens, the whole sequence's document bounds",
    "cu_seqlens_k": "pass cu_seqlens, the whole sequence's document bounds",
}


def _check_params(mod, params, hq):
    names = tuple(mod.PARAM_NAMES)
    for name in params:
        if name in NOT_TAKEN and name not in names:
            raise ValueError(f"ring_attention does not take {name}: {NOT_TAKEN[name]}")
    unknown = [name for name in params if name not in names]
    missing = [name for name in names if name not in params]
    if unknown or missing:
        what = (f"unknown parameter(s) {', '.join(map(repr, unknown))}" if unknown else
                f"missing parameter(s) {', '.join(map(repr, missing))}")
        raise ValueError(f"ring_attention: {what}; the prior {mod.PRIOR['name']!r} takes "
                         f"{', '.join(names) or 'no parameters'} (the shapes of its attention())")
    for name, value in params.items():
        _block(mod.TRAITS, name, value, hq, "cpu")   # (a ValueError naming it and its shapes)


def _check_blocks(mod, q, k, v, causal, scale, backend, params):
    """The block API's own checks (dtype, head dim, backend, the parameters' domains), run on
    this rank's shards before the ring sends anything. forward_block and backward_block make
    them on every block, but there a refusal comes after the next step's K/V transfer is
    posted: every rank raises with it in flight, and the group's next call pairs its messages
    with it (gloo times out, NCCL hangs). params: the values the blocks are given."""
    check_inputs(q, k, v, causal, scale, backend)
    use_triton(q, backend)   # (backend='triton' without CUDA, or in float64)
    prior = mod._prior
    make_theta(prior.traits, q, params, grad=False, check=prior.domain_check, head_rows=True)


def _check_span(span: int):
    """The block API refuses a block whose positions or distances pass 2**24 (exact integers in
    float32): a query sees at most `span` keys (the sequence, or its longest packed document),
    so refuse such a sequence on every rank before the ring starts, not on some ranks midway."""
    if span - 1 > MAX_POSITION:
        raise ValueError(f"positions 0 .. {span - 1} (the sequence, or its longest packed "
                         f"document) pass 2**24, where positions are exact integers in float32; "
                         f"split it into documents (cu_seqlens) or shorten it")


def _block(traits, name, value, hq, device):
    """A parameter's columns [Hq, width] (float32), as the runtime takes them."""
    return param_block(traits.param(name), value, hq, device, torch.float32)


def ring_attention(mod, q, k, v, causal=True, group=None, *, scale=None, backend="auto",
                   cu_seqlens=None, pos_q=None, pos_k=None, **params):
    """Attention of this rank's shard of queries over the whole sequence, the keys and values
    passed around the context-parallel `group`; equal to `mod.attention` on the full tensors.

    mod: a generated module (e.g. `generated.generalized_gaussian` or `bamgen.load(...)`).
    q [B, Hq, 2c, D], k and v [B, Hk, 2c, D]: this rank's shards from `shard` (same layout,
        same shapes on every rank); positions are those of the whole sequence, 0 .. N-1.
    causal, scale, backend: as in `mod.attention`.
    cu_seqlens: packed documents (B = 1): int [docs + 1], the whole sequence's document bounds
        (0, ..., N), the same on every rank; a query sees only its own document's keys and
        positions restart at each document, as `mod.attention(..., cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens)`. Chunk pairs that share no document are neither computed nor
        sent.
    pos_q, pos_k: positions as tensors (docs/positions.md), this rank's shards of them
        (`shard(c, group=cp, dim=...)`, the sequence dimension of [B, N], [B, Hq, N] or with
        channels [B, N, C], [B, Hq, N, C]); the keys' positions travel with K and V, their
        gradients come home with dK and dV; masks keep following token order.
    **params: the prior's parameters, in the shapes its attention() takes (a float or a tensor
        [Hq] for a scalar, [Hq, size] or [size] for a vector), the same values on every rank; tensors that require grad get the gradient of the whole sequence (summed
        over the group), e.g. the values of `layer.prior_params()`.
    Returns this rank's shard of the output [B, Hq, 2c, D] in q's dtype (the autocast dtype under
    torch.autocast, as `mod.attention`). Differentiable in q, k, v and the parameters; every
    rank of the group must call it (and its backward) alike. Before the ring sends anything the
    ranks share, in one small all_gather, whether each accepts the call and its shapes: a call
    that any rank refuses, or whose shards differ in shape between ranks, raises a ValueError
    on every rank (naming the rank) and leaves the group ready for its next call.
    """
    rank, world = _rank_and_size(group)
    try:
        plan = _plan(mod, q, k, v, causal, scale, backend, world, cu_seqlens, pos_q, pos_k, params)
        row, refusal = plan.row(causal, world), None
    except Exception as err:   # (whatever it is: raised on some ranks only, the others would wait)
        row, refusal = None, err
    rows = _agree(group, world, row, refusal, _row_width(world), "this call",
                  q.device if isinstance(q, torch.Tensor) else None)
    _check_alike(rows, group)
    check_integer_distances(_agreed_extent(rows))
    chunk = plan.q.shape[2] // 2
    distances = None if plan.window is None else _agreed_distances(rows, world)
    ring = _Ring(group, rank, world, chunk, causal, distances, plan.docs)
    call = _Call(mod, causal, scale, backend, 2 * world * chunk if plan.uses_n else None, plan.window)
    pos = () if plan.pos is None else (plan.pos.q, plan.pos.k)
    return _RingAttention.apply(ring, call, plan.fixed, plan.q, plan.k, plan.v, plan.learned, *pos)


def _checked_inputs(mod, q, k, v, causal, scale, backend, params):
    """q, k, v as the ring takes them (under torch.autocast, its dtype), once the call's
    arguments are checked on their own."""
    _check_module(mod)
    q, k, v = autocast_inputs(q, k, v)   # as mod.attention takes them under torch.autocast
    _check_shards(q, k, v)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    _check_params(mod, params, q.shape[1])
    return q, k, v


def _plan(mod, q, k, v, causal, scale, backend, world, cu_seqlens, pos_q, pos_k, params) -> _Plan:
    """Every check this rank can make on its own shards (the arguments, the block API's checks,
    positions, documents, the 2**24 bound) and the call they leave, before anything is sent:
    the blocks make the same checks, but a refusal there comes with messages in flight."""
    q, k, v = _checked_inputs(mod, q, k, v, causal, scale, backend, params)
    check_causal(mod.TRAITS, causal, pos_q, pos_k)
    hq = q.shape[1]
    traits = _traits(mod)
    pos = given_positions(mod._prior, q, k, pos_q, pos_k)
    if pos is not None:   # the window is found over token distances: none with positions
        traits = _RingTraits(uses_n=traits.uses_n, window=False)
    learned = (torch.cat([_block(mod.TRAITS, name, params[name], hq, q.device) for name in mod.LEARNABLE],
                         dim=1)
               if mod.LEARNABLE else torch.zeros(hq, 0, dtype=torch.float32, device=q.device))
    fixed = {name: value for name, value in params.items() if name not in mod.LEARNABLE}
    _check_blocks(mod, q, k, v, causal, scale, backend, _block_params(mod, fixed, learned))
    chunk = q.shape[2] // 2
    plan = _Plan(q, k, v, pos, learned, fixed, traits.uses_n)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed documents (cu_seqlens) take B = 1: the documents lie one after "
                             f"another in dim 2, got B = {q.shape[0]}")
        cuts, docs = _documents(cu_seqlens, 2 * world * chunk)
        plan = replace(plan, cuts=cuts, docs=docs)
    span = 2 * world * chunk if plan.docs is None else max(b - a for a, b in plan.docs.bounds)
    _check_span(span)
    if traits.window:
        window = _Window(mod, _block_params(mod, fixed, learned), hq, q.device, traits.skip_below)
        plan = replace(plan, window=window,
                       distances=window.chunk_distances(chunk, world, causal, span))
    return plan
