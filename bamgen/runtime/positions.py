"""Positions as tensors (docs/positions.md): pos_q and pos_k replace the token positions that the
offsets give, so that a prior reads i, j and d from what the model computes (the Forgetting
Transformer's cumulative log forget gates, randomized positions, a patch grid).

Here: the common layouts (grid), and the checks that turn a call's pos_q / pos_k into the one
form both backends read, [B, Hq, N, C] in the compute dtype. That form is made by views and a
dtype conversion only, so autograd sums a gradient over the heads of a [B, N] tensor by itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import MAX_POSITION, as_int
from .tables import acc_dtype


def grid(*sizes: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The coordinates of a row-major grid, [prod(sizes), len(sizes)]: grid(h, w) gives each
    patch of an h x w image its (row, column), grid(t, h, w) each patch of a video its
    (frame, row, column). Add the batch dimension for pos_q / pos_k:
    grid(h, w).expand(B, -1, -1)."""
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"grid() takes positive int sizes, e.g. grid(14, 14); got {sizes!r}")
    axes = [torch.arange(n, dtype=dtype, device=device) for n in sizes]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(sizes))


@dataclass(frozen=True)
class Positions:
    """A call's positions as both backends read them: q [B, Hq, Nq, C] and k [B, Hq, Nk, C] in
    the compute dtype (views of the user's tensors where they can be: gradients flow back
    through them)."""
    q: torch.Tensor
    k: torch.Tensor
    # (smallest q, largest q, smallest k, largest k) where both were given as integers: the
    # range check read them, so the Triton kernels' choice of a table (launch.position_call)
    # need not read them again; None for float positions, and under tracing
    extent: tuple[int, int, int, int] | None = None

    @property
    def channels(self) -> int:
        return self.q.shape[-1]

    def detached(self) -> "Positions":
        return Positions(self.q.detach(), self.k.detach(), self.extent)


def positions_of(prior, q, k, pos_q, pos_k, q_offset, k_offset, cu_seqlens_q) -> Positions | None:
    """The call's Positions, or None for token positions; a ValueError naming the argument for
    anything a call cannot mean. (Packed documents take them as they take q and k: [1, N] or
    [1, Hq, N], each document's tokens at its own place; masks follow the documents.)"""
    pos = given_positions(prior, q, k, pos_q, pos_k)
    if pos is not None:
        check_integer_distances(pos.extent)
        for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
            if as_int(off) is None:   # (a tensor, a float: the message that fits positions)
                raise ValueError(f"{name} must be an int when pos_q and pos_k are given (per-row "
                                 f"tensor offsets are not taken with positions): the positions "
                                 f"place each token for the prior, and int offsets place the "
                                 f"rows among the keys for the causal mask (a chunk after a cache: "
                                 f"q_offset = its first row's index among the keys)")
    return pos


def given_positions(prior, q, k, pos_q, pos_k) -> Positions | None:
    """pos_q and pos_k as a Positions (None for token positions), whatever the offsets: the
    block API (blocks.py) and the ring take both, the offsets placing tokens for the masks and
    the positions placing them for the prior."""
    channels = prior.traits.channels
    if pos_q is None and pos_k is None:
        if channels > 1:
            raise ValueError(f"pos_q is required: the prior {prior.traits.name!r} reads "
                             f"{channels} position channels (positions: {channels}); pass "
                             f"pos_q and pos_k of shape [B, N, {channels}] or "
                             f"[B, Hq, N, {channels}], e.g. the prior module's grid(h, w) "
                             f"(bamgen.positions.grid)")
        return None
    if pos_q is None or pos_k is None:
        missing = "pos_q" if pos_q is None else "pos_k"
        raise ValueError(f"{missing} is missing: pos_q and pos_k come together (pass the same "
                         f"tensor twice for self-attention)")
    B, Hq, Nq = q.shape[0], q.shape[1], q.shape[2]
    cdt = acc_dtype(q)
    normalised_q = _normalise("pos_q", pos_q, B, Hq, Nq, channels, q, cdt)
    normalised_k = _normalise("pos_k", pos_k, B, Hq, k.shape[2], channels, q, cdt)
    return Positions(normalised_q, normalised_k, _integer_extent(pos_q, pos_k, q))


def _integer_extent(pos_q, pos_k, q) -> tuple[int, int, int, int] | None:
    """Integer positions within +-2**24, where float32, the kernels' positions, holds every
    integer: beyond, distances round (2**24 + 13 and 2**24 + 12 read alike) and the prior is
    silently wrong, as the offsets' range check (checks.check_positions) refuses for token
    positions. One host read for both tensors (on a GPU it waits for the queue), not under
    tracing, where values are unknown (the custom ops check traced_bounds' instead). Returns
    (q_lo, q_hi, k_lo, k_hi) where both are integer and hold some position, for the table's
    choice (Positions.extent), else None."""
    from .ops import tracing
    named = _integer_tensors(pos_q, pos_k)
    if not named or tracing(q):
        return None
    bounds = torch.stack([b.to(torch.int64) for _, p in named for b in p.aminmax()]).tolist()
    return check_integer_range([name for name, _ in named], bounds)


def _integer_tensors(pos_q, pos_k) -> list:
    """(name, tensor) of the given positions that are integers and hold some position."""
    return [(name, p) for name, p in (("pos_q", pos_q), ("pos_k", pos_k))
            if isinstance(p, torch.Tensor) and not p.is_floating_point() and p.numel()]


def check_integer_range(names, bounds) -> tuple[int, int, int, int] | None:
    """The range check of _integer_extent on (lo, hi) per named tensor, flattened in bounds;
    returns the extent where both tensors are named."""
    for name, lo, hi in zip(names, bounds[0::2], bounds[1::2]):
        worst = lo if -lo > hi else hi
        if abs(worst) > MAX_POSITION:
            raise ValueError(f"{name} holds {worst}: integer positions must lie in [-2**24, "
                             f"2**24], where float32 holds every integer (beyond, distances "
                             f"round); shift them (a prior of d alone reads only differences), "
                             f"or pass float positions, computed to float32's rounding")
    return tuple(bounds) if len(names) == 2 else None


def traced_bounds(pos_q, pos_k) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each integer position tensor's (smallest, largest) as an int64 tensor [2], None for a
    float one: under tracing the values are unknown when attention() runs, so the positional
    custom op, which runs on the values, makes eager's checks on these (check_traced_bounds).
    Computed in the graph: no host read while tracing."""
    integer = dict(_integer_tensors(pos_q, pos_k))
    return tuple(torch.stack(list(integer[name].aminmax())).to(torch.int64)
                 if name in integer else None for name in ("pos_q", "pos_k"))


def check_traced_bounds(q_bounds, k_bounds) -> tuple[int, int, int, int] | None:
    """Eager's checks of integer positions (range, then distances) on traced_bounds' tensors,
    in one host read; returns the extent where both are integer, as Positions.extent."""
    named = [(name, b) for name, b in (("pos_q", q_bounds), ("pos_k", k_bounds)) if b is not None]
    if not named:
        return None
    bounds = torch.cat([b for _, b in named]).tolist()
    extent = check_integer_range([name for name, _ in named], bounds)
    check_integer_distances(extent)
    return extent


def check_integer_distances(extent) -> None:
    """Integer positions' distances within +-2**24, as the offsets' check refuses token
    positions further apart (checks.check_positions): beyond, they round. A whole call's check
    (attention(), the module; the ring, on the extent over every rank's shards, which the
    ranks share before the ring starts): the block API sees one block of the keys."""
    if extent is None:
        return
    q_lo, q_hi, k_lo, k_hi = extent
    far = max(abs(q_hi - k_lo), abs(k_hi - q_lo))
    if far > MAX_POSITION:
        raise ValueError(f"pos_q and pos_k ({q_lo}..{q_hi}, {k_lo}..{k_hi}): distances between "
                         f"queries and keys reach {far}, beyond 2**24, where they are exact "
                         f"integers in float32; bring them closer (a prior of d alone reads only "
                         f"differences: shift both by one integer)")


def _normalise(name, pos, B, Hq, N, channels, q, cdt) -> torch.Tensor:
    """pos as [B, Hq, N, C] in the compute dtype, or a ValueError naming it."""
    if not isinstance(pos, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(pos).__name__}")
    if pos.dtype == torch.bool or pos.is_complex():
        raise ValueError(f"{name} must hold float or integer positions, got {pos.dtype}")
    if pos.device != q.device:
        raise ValueError(f"{name} is on {pos.device} and q on {q.device}: move {name} to "
                         f"{q.device}")
    if channels == 1 and list(pos.shape) == [B, Hq, N, 1]:   # the normalised form itself
        return pos.to(cdt)
    c = [] if channels == 1 else [channels]
    shapes = {2 + len(c): [B, N, *c], 3 + len(c): [B, Hq, N, *c]}
    want = shapes.get(pos.dim())
    if want is None or list(pos.shape) != want:
        ch = f", {channels}" if channels > 1 else ""
        raise ValueError(f"{name} has shape {list(pos.shape)}; expected [B, N{ch}] = "
                         f"[{B}, {N}{ch}] or [B, Hq, N{ch}] = [{B}, {Hq}, {N}{ch}]")
    if channels == 1:
        pos = pos.unsqueeze(-1)
    if pos.dim() == 3:   # shared by every head
        pos = pos.unsqueeze(1).expand(B, Hq, N, channels)
    return pos.to(cdt)
