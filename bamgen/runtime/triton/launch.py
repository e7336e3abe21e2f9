"""The GPU path's host side: tiles and autotuning, the layout arguments, the prior's inputs
(distance table, block-skipping window, key counts), the launches of the forward, decode and
backward kernels, and the kernels' specialisations for ahead-of-time compiles.

The kernels themselves are library code (forward.py, backward.py, decode.py, helpers.py),
instantiated per prior with its hooks and flags (variant.py: Prior.kernels()).

Table arguments of the kernels (table strategy): the Table pointer, d_top (the largest distance
in the call plus TABLE_PAD), tab_slot (entries per table: Nq + Nk - 1 + 2 TABLE_PAD) and
tab_stride_h (floats per head); the kernels take d_top_b = d_top + TABLE_ROW_BIAS (TABLE_ROW_ARGS).
Entry t of a table holds distance d_top - t: a query's entries, by increasing key position, are
then consecutive in memory, and TABLE_PAD entries either side keep the masked-off corners of edge
tiles inside the table, so the loads need no mask. The tables are filled in float64: for CUDA
tensors by the table kernels (table.py, distance_table), else by torch (bamgen/runtime/tables.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, field

import torch
import triton

from ..checks import MAX_POSITION
from ..constants import LOG2E, POSITION_TABLE_SPAN, TABLE_PAD
from ..host_reads import HOST_READS, values
from ..tables import distance_span, prior_tables, row_key_counts
from . import interpreting
from .helpers import TABLE_ROW_ARGS, TABLE_ROW_BIAS  # noqa: F401 (the kernels' d_top_b)
from .tiles import (FWD_TABLE_GATHER, GRAD_GROUPS, GRAD_GROUPS_MASKED, INTERPRET_TILES,
                    TABLE_GATHERS, TILES, fwd_table_gather, fwd_tma_tile, head_dim_bucket,
                    reads_kv_through_tma, splits_steady)

PREPROCESS = (32, 4)  # rows per program and warps of the backward's rowsum(dO * O)
# No implicit FMA contraction in the attention kernels. The backward rebuilds P = exp2(z - m) / l
# from the forward's row statistics, exact only if it recomputes every logit z bit for bit as
# the forward did. With contraction on, the compiler fuses a multiply into the next add in one
# kernel and not in another (it depends on the surrounding code), and at |z| ~ 1e4 (a sharp
# prior far from its mode: every key of a row has a large log-prior) one rounding step of z
# moves P by 0.1% or more on every such row, which dV sums up (seen on an H100: dV off by up to
# 0.6 while O, dQ and dK were right). Explicit tl.fma calls are kept; only implicit fusion is off.
FP_FUSION = False
# The decode kernels (decode.py) take a call of at most DECODE_ROWS query rows
# with no backward to follow (a generation step), its keys split over programs.
DECODE_ROWS = 16
DECODE_MIN_KEYS = 256         # keys per split at least: fewer, and merging costs what splitting saves
DECODE_MAX_SPLITS = 64        # splits per row at most: the merge holds them all in registers
DECODE_WAVES = 2              # aim for this many programs per SM
DECODE_INTERPRET_KEYS = 32    # keys per split under TRITON_INTERPRET=1: tests cross split borders
COMBINE_WARPS = 4
DECODE_COMBINE_SPLITS = 32    # (the splits an ahead-of-time compile of the merge assumes)


def gpu_family(device=None):
    """"sm_90" for Hopper and newer, else "sm_80" (the config table's keys)."""
    major, _ = torch.cuda.get_device_capability(device)
    return "sm_90" if major >= 9 else "sm_80"


TILE_FAMILIES = tuple(sorted(TILES["light"]))   # the tile tables' GPU families: sm_80, sm_90


def interpreted_family():
    """Under the interpreter, the GPU family whose tiles, table read and dQ groups the kernels
    take (BAMGEN_INTERPRET_TILES=sm_80|sm_90: the tile logic a GPU runs, checked on the CPU);
    None, the default: the interpreter's small tiles (INTERPRET_TILES), which cross many tile
    borders in a small test."""
    family = os.environ.get("BAMGEN_INTERPRET_TILES", "")
    if family in ("", "0"):
        return None
    if family not in TILE_FAMILIES:
        raise ValueError(f"BAMGEN_INTERPRET_TILES={family!r}: give one of "
                         f"{', '.join(TILE_FAMILIES)}, or leave it unset for the interpreter's tiles")
    return family


def candidates(prior, kernel, head_dim, arch, masked=False, tma=False):
    """The tile configs of a kernel; masked (key_mask, per-row offsets or packed documents): each
    with half the tile's scores (_masked_tile). (The kernels of position tensors have tile
    kinds of their own: tiles.py, positions_light and positions.) tma: a forward that reads K
    and V through TMA (kv_tma) takes its own tile first (tiles.FWD_TMA_AT), then the table's."""
    table = TILES[prior.traits.tile_kind][arch]
    bucket = head_dim_bucket(head_dim_padded(head_dim))
    configs = table[bucket][kernel]
    tma_tile = fwd_tma_tile(prior.traits.tile_kind, arch, bucket) if tma and kernel == "fwd" else None
    if tma_tile is not None:
        configs = [tma_tile] + [c for c in configs if c != tma_tile]
    if masked and prior.traits.tensor_positions:
        return [positions_masked_tile(kernel, c, arch, bucket) for c in configs]
    if masked and kernel == "fwd" and prior.traits.tile_kind == "heavy":
        return [heavy_masked_forward(c) for c in configs]
    return [masked_tile(kernel, c) for c in configs] if masked else configs


def heavy_masked_forward(config):
    """masked_tile's forward for the heavy kind (FIRE), whose key tile is often at masked_tile's
    floor of 32 already: there half the query tile instead. FIRE's masked forward at head dim
    128 on sm_90 kept 64x32 and put 8 (key_mask) and 80 (packed) bytes on the stack."""
    block_m, block_n, warps, stages = config
    if block_n > 32:
        return masked_tile("fwd", config)
    return (max(16, block_m // 2), block_n, warps, stages)


def positions_masked_tile(kernel, config, arch, head_dim):
    """masked_tile for the positional tables, whose tiles may already be at masked_tile's
    floor: on sm_90 a dK/dV tile of 16 rows takes half the keys instead (BAM-SSMax at head dim
    128: 16x64 put 16 bytes on the stack), and at head dims past 64 one pipeline stage (BAM's
    16x32 over two put 8 bytes there, 255 registers; one takes 247 and none, modelled 11%
    slower; at 64 one stage is what spills, KERPLE's and others'),
    on sm_80 a forward of 32 keys takes 16x32 (the packed forward of GGD, ALiBi and BAM-SSMax
    put 8-24 bytes on the stack at 64x32 and 32x32, ptxas capping a thread at 128 or 168
    registers; 16x32 takes 96-128 and none), and a dK/dV tile of 16 rows past head dim 64 one
    stage (NoPE's packed 16x32 over two put 16 bytes there at 168 registers once its kernels
    stopped summing positions' gradients that are 0, traits.position_grads; one takes 165 and
    none, every positional prior's spill-free, modelled 11% slower: LSU-bound)."""
    block_m, block_n, warps, stages = config
    if kernel == "fwd" and block_n <= 32 and arch == "sm_80":
        return (16, 32, 4, stages)
    if kernel == "bwd_dkdv" and block_m <= 16 and arch == "sm_90":
        return (16, max(16, block_n // 2), warps, 1 if head_dim > 64 else stages)
    if kernel == "bwd_dkdv" and block_m <= 16 and arch == "sm_80" and head_dim > 64:
        return (block_m, block_n, warps, 1)
    return masked_tile(kernel, config)


def masked_tile(kernel, config):
    """The tile of a masked launch. The layout's state (the mask bytes of a key tile, the
    document's bounds, the row's offsets) lives in registers through the main loop; with the
    plain tiles, chosen at the edge of the register file, it would spill at head dim 128. The
    rules below free what it needs (tests/gpu/test_aot_masks.py compiles them spill-free; the
    figures are in docs/performance.md)."""
    block_m, block_n, warps, stages = config
    if kernel == "decode":    # a few rows: the tile has room for the layout's state
        return config
    if kernel == "fwd":       # half the key tile (down to 32)
        return (block_m, max(32, block_n // 2), warps, stages)
    if kernel == "bwd_dq":    # the same tile over 8 warps (fewer registers per thread)
        return (block_m, block_n, 8, stages)
    return (max(16, block_m // 2), block_n, warps, stages)   # dK/dV: half the query tile



@dataclass(frozen=True)
class Pins:
    """Launch choices fixed for the calls inside pinned(): a tile config per kernel name
    (KERNELS' keys, "fwd", "bwd_dq", ...), the forward's table gather (TABLE_GATHERS) and
    whether the dQ and dK/dV kernels split off their steady runs (SPLIT_STEADY; None: the
    tile table's), how the forward and decode kernels read K and V (KV_READS: "tma" where
    the layout allows it, kv_tma; None: what tiles.KV_TMA_SHIPPED ships, pointers) and where a
    table prior's distance table is built (TABLE_BUILDS: "host", torch's operations; "device",
    the table kernels where the prior has them; None: the kernels for CUDA tensors,
    distance_table) and how many learnable scalars a dQ launch sums (None: grad_groups')."""
    tiles: dict = field(default_factory=dict)
    gather: str | None = None
    dq_split: bool | None = None
    dkdv_split: bool | None = None
    kv: str | None = None
    table: str | None = None
    dq_group: int | None = None


KV_READS = ("pointers", "tma")
TABLE_BUILDS = ("device", "host")


_PINS = contextvars.ContextVar("bamgen_pins", default=Pins())


@contextlib.contextmanager
def pinned(tiles=None, gather=None, dq_split=None, dkdv_split=None, kv=None, table=None,
           dq_group=None):
    """Within it, every launch of a kernel named in ``tiles`` ({"fwd": (128, 64, 8, 3)}) takes
    that tile config instead of the tile table's (BAMGEN_AUTOTUNE and the interpreter's small
    tiles included), the forward and decode kernels read a table as ``gather`` says, and the
    dQ and dK/dV kernels split off their steady runs or not as ``dq_split`` and ``dkdv_split``
    (True or False) say (tiles.STEADY_AT otherwise), and the forward reads K and V as ``kv``
    says ("pointers", or "tma" wherever kv_tma allows it; its tile, unless pinned, is then
    tiles.FWD_TMA_AT's where the prior's kind has one), and a table prior's distance table is
    built as ``table`` says ("host": by torch's operations; "device": by the table kernels
    where the prior has them, under the interpreter too), and a dQ launch sums ``dq_group``
    learnable scalars (tiles.GRAD_GROUPS' choice otherwise): so that a benchmark times one kernel
    variant against another in the same process (benchmarks/gpu.py's bamgen-<prior>@...
    peers). A block inside another adds to its pins.

    Pins are read where a kernel is launched, on the calling thread: a backward run in the
    block takes them, but autograd runs a CUDA backward on a thread of its own unless
    torch.autograd.set_multithreading_enabled(False) keeps it on this one (benchmarks/gpu.py
    does); under torch.compile they are read when the launch is traced, so a graph keeps the
    pins it was compiled with. Nothing checks that a pinned config compiles without spills, as
    the tile table's do (tests/gpu/test_aot.py)."""
    tiles = dict(tiles or {})
    unknown = sorted(set(tiles) - set(INTERPRET_TILES))
    if unknown:
        raise ValueError(f"pinned(tiles=...): no kernel {unknown[0]!r}; the kernels are "
                         f"{', '.join(INTERPRET_TILES)}")
    for name, config in tiles.items():
        if not _tile_config(config):
            raise ValueError(f"pinned(tiles=...): {name}={config!r} is not a tile config "
                             f"(BLOCK_M, BLOCK_N, num_warps, num_stages): blocks powers of two "
                             f">= 16 and <= {TABLE_PAD}, warps a power of two up to 16, stages >= 1")
    if gather is not None and gather not in TABLE_GATHERS:
        raise ValueError(f"pinned(gather=...): {gather!r} is not one of {', '.join(TABLE_GATHERS)}")
    for name, split in (("dq_split", dq_split), ("dkdv_split", dkdv_split)):
        if split is not None and not isinstance(split, bool):
            raise ValueError(f"pinned({name}=...): {split!r} is not True or False (or None: the "
                             f"tile table's choice)")
    if kv is not None and kv not in KV_READS:
        raise ValueError(f"pinned(kv=...): {kv!r} is not one of {', '.join(KV_READS)} (or None: "
                         f"the tile table's choice)")
    if table is not None and table not in TABLE_BUILDS:
        raise ValueError(f"pinned(table=...): {table!r} is not one of {', '.join(TABLE_BUILDS)} "
                         f"(or None: the device's where the prior has the table kernels)")
    if dq_group is not None and (isinstance(dq_group, bool) or not isinstance(dq_group, int)
                                 or dq_group < 1):
        raise ValueError(f"pinned(dq_group=...): {dq_group!r} is not a count of learnable scalars "
                         f"(an int >= 1; or None: the tile table's choice)")
    outer = _PINS.get()
    token = _PINS.set(Pins({**outer.tiles, **{k: tuple(v) for k, v in tiles.items()}},
                           gather or outer.gather, outer.dq_split if dq_split is None else dq_split,
                           outer.dkdv_split if dkdv_split is None else dkdv_split,
                           kv or outer.kv, table or outer.table, dq_group or outer.dq_group))
    try:
        yield
    finally:
        _PINS.reset(token)


def _tile_config(config) -> bool:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) as a kernel can take it: blocks of at least one
    MMA (16) and powers of two, as tl.arange and tl.dot need, and at most TABLE_PAD, the entries
    a distance table keeps either side of the call's distances: a tile's table reads past the
    last row or key (and the forward's read one key tile ahead) stay inside it."""
    if len(config) != 4 or not all(type(x) is int for x in config):
        return False
    block_m, block_n, warps, stages = config
    power = lambda x: x > 0 and x & (x - 1) == 0   # noqa: E731
    return (power(block_m) and power(block_n) and 16 <= min(block_m, block_n)
            and max(block_m, block_n) <= TABLE_PAD and power(warps) and warps <= 16 and stages >= 1)


def table_gather(device=None, head_dim=None):
    """A kernel's TABLE_GATHER: the pinned one, else the forward's read for the device's family
    and head dim (tiles.fwd_table_gather), else tiles.FWD_TABLE_GATHER (the decode kernel, and
    the interpreter unless BAMGEN_INTERPRET_TILES names a family: every read computes the same
    there)."""
    pinned = _PINS.get().gather
    if pinned:
        return pinned
    if device is None or head_dim is None:
        return FWD_TABLE_GATHER
    family = interpreted_family() if interpreting() else gpu_family(device)
    return FWD_TABLE_GATHER if family is None else fwd_table_gather(family, head_dim)


def split_steady(prior, kernel, device, head_dim) -> bool:
    """A backward kernel's ("bwd_dq", "bwd_dkdv") SPLIT_STEADY: the pinned one (dq_split,
    dkdv_split), else tiles.splits_steady for the device's family (under the interpreter: the
    one BAMGEN_INTERPRET_TILES names, else the interpreter's tiles, None), the prior's tile kind
    and the (padded) head dim."""
    pins = _PINS.get()
    pin = pins.dq_split if kernel == "bwd_dq" else pins.dkdv_split
    if pin is not None:
        return pin
    family = interpreted_family() if interpreting() else gpu_family(device)
    return splits_steady(kernel, prior.traits.tile_kind, family, head_dim)


def kv_tma(prior, q, k, v, lay, traced, kernel="fwd") -> bool:
    """Whether the forward or decode kernel reads K and V through tensor descriptors (KV_TMA;
    tiles.FWD_TMA_AT, DECODE_TMA_AT): pinned(kv=...), else where tiles.KV_TMA_SHIPPED ships it
    (nowhere since an H200 timed it) for the device's family (under the interpreter: the one
    BAMGEN_INTERPRET_TILES names, else none), the prior's tile kind and the head dim.
    Either way only where the layout allows: an eager launch (a traced one keeps pointers),
    no key mask, per-row offsets or packed documents (KernelLayout.masked: a padding key's v
    must read as 0, and a document's last tile runs into the next document), 16-bit inputs,
    and rows of K and V that start 16-byte aligned (D a multiple of 8, the tensors' bases
    aligned), as a descriptor needs."""
    pin = _PINS.get().kv
    if pin == "pointers":
        return False
    if pin is None:
        family = interpreted_family() if interpreting() else gpu_family(q.device)
        if not reads_kv_through_tma(kernel, prior.traits.tile_kind, family,
                                    head_dim_padded(q.shape[3])):
            return False
    return (not traced and not lay.masked and q.dtype in (torch.float16, torch.bfloat16) and q.shape[3] % 8 == 0
            and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)


def kv_descriptor_type(dtype: str, block_n: int, head_dim: int) -> str:
    """The Triton signature type of kv_descriptors' descriptors, for ahead-of-time compiles."""
    return f"tensordesc<{dtype}[1, {block_n}, {head_dim}]>"


def kv_descriptors(k, v, block_n, head_dim):
    """Tensor descriptors of contiguous K and V [B, Hk, Nk, D] as [B * Hk, Nk, D] with a block
    of [1, block_n, head_dim] (the padded head dim): a tile past Nk or D reads zeros, as the
    pointer loads' masks give."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    B, Hk, Nk, D = k.shape
    return tuple(TensorDescriptor.from_tensor(t.view(B * Hk, Nk, D), [1, block_n, head_dim])
                 for t in (k, v))


def launch(prior, kernel, head_dim, device, key, run, masked=False, traced=False, tma=False):
    """run(config) launches `kernel` with a tile config and returns what the caller needs.

    The config is a pinned one (pinned(): over everything below), the family's default, the
    interpreter's small one (or, with BAMGEN_INTERPRET_TILES, the named family's default), or
    with BAMGEN_AUTOTUNE=1
    on a GPU the fastest candidate for this key (dtype, causal, head dim, length bucket): each
    candidate runs twice (compile, then timed); one that does not fit the device's shared memory
    (Triton raises) or that spills registers is dropped. Every kernel only overwrites its
    outputs, so the timing runs leave nothing behind but the result of the last run. A traced
    launch (the triton ops) takes a config an eager call tuned for its key, else the default: a
    trace cannot time anything."""
    pin = _PINS.get().tiles.get(kernel)
    if pin is not None:
        return run(pin)
    if interpreting():
        family = interpreted_family()
        if family is None:
            return run(INTERPRET_TILES[kernel])
        return run(candidates(prior, kernel, head_dim, family, masked, tma)[0])
    arch = gpu_family(device)
    options = candidates(prior, kernel, head_dim, arch, masked, tma)
    if os.environ.get("BAMGEN_AUTOTUNE", "0") != "1" or len(options) == 1:
        return run(options[0])
    if traced:
        return run(prior.tuned.get((kernel, arch, head_dim, masked, tma) + key, options[0]))
    tuned_key = (kernel, arch, head_dim, masked, tma) + key
    if tuned_key not in prior.tuned:
        prior.tuned[tuned_key] = _autotune(options, run)
    return run(prior.tuned[tuned_key])


def _autotune(candidates, run):
    timings = []
    for config in candidates:
        try:
            run(config)                      # compile (and check the resources)
        except Exception as exc:             # Triton's OutOfResources: too much shared memory
            if "OutOfResources" not in type(exc).__name__:
                raise
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        compiled = run(config)
        end.record()
        torch.cuda.synchronize()
        if getattr(compiled, "n_spills", 0):
            continue
        timings.append((start.elapsed_time(end), config))
    if not timings:
        raise RuntimeError("no tile configuration fits this GPU; please report it")
    return min(timings)[1]


def head_dim_padded(D):
    return max(16, 1 << (D - 1).bit_length())


def dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype):
    return dtype == torch.bfloat16 and interpreting()


def prior_inputs(prior, q, k, theta, q_offset, k_offset, causal, with_grads, shifted, table=None, n=None,
                 key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, span=None):
    """What the kernels read of the prior: (table, d_top, window, counts). table: the call's
    distance table (distance_table, with its derivative slots if with_grads),
    or the forward's when given; theta itself, a placeholder, for the inline strategy, whose
    kernels take the table arguments and ignore them. window: _prior_window; counts:
    _row_key_counts (n: its override). span: the distances of integer position tensors
    (PositionCall), else the tokens' (distance_span)."""
    B, _, Nq, _ = q.shape
    Nk = k.shape[2]
    spans = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if prior.traits.table:
        bottom, top = span if span is not None else distance_span(Nq, Nk, q_offset, k_offset, **spans)
        if table is None:
            # (positions: any distance of the span may be visible, so the shift takes them all)
            table, d_top = distance_table(prior, theta, bottom, top, causal and span is None,
                                          with_grads, shifted)
        else:
            d_top = top + TABLE_PAD
    else:
        table, d_top = theta, 0
    counts = row_key_counts(prior, B, Nq, Nk, q_offset, k_offset, causal, q.device, n, key_mask, **spans)
    return table, d_top, prior_window(prior, table, d_top), counts


@dataclass(frozen=True)
class PositionCall:
    """The kernels that take a call's position tensors and what they read: prior (the prior's
    positional plan, or its table at integer positions: Prior.position_table), pos (pos_q, pos_k
    [B, Hq, N, C] float32 as the kernels read them) and span ((bottom, top) of the table's
    distances; None inline)."""
    prior: object
    pos: tuple
    span: tuple | None = None


def position_call(prior, pos, position_grads, extent=None) -> PositionCall:
    """How the kernels take a call's position tensors (docs/positions.md, "Integer positions").
    A table prior (Prior.position_table) whose positions are all integers, need no gradient,
    and span at most POSITION_TABLE_SPAN * (Nq + Nk) distances reads its distance table at
    d = pos_i - pos_j, as it does at token positions. Otherwise (and while a CUDA graph is being
    captured: deciding reads five numbers on the host) the positional plan computes the prior
    inline. extent: the positions' (q_lo, q_hi, k_lo, k_hi) where the caller read them of
    integer tensors (Positions.extent), else they are read here."""
    table_prior = getattr(prior, "position_table", None)
    inline = PositionCall(prior.positional, pos)
    pos_q, pos_k = pos
    if (position_grads or table_prior is None or pos_q.shape[-1] != 1 or pos_q.numel() == 0
            or pos_k.numel() == 0 or (pos_q.is_cuda and torch.cuda.is_current_stream_capturing())):
        return inline
    if extent is not None:
        q_lo, q_hi, k_lo, k_hi = (float(x) for x in extent)
    else:
        # (float32 positions: an integer there is exact, and so is the difference of two of
        # them up to 2**24)
        # (NaN fails p == p.round(), an infinity does not: isfinite)
        integral = torch.stack([((p == p.round()) & p.isfinite()).all() for p in pos]).all()
        q_lo, q_hi, k_lo, k_hi, whole = torch.stack(
            [pos_q.min(), pos_q.max(), pos_k.min(), pos_k.max(), integral.float()]).tolist()
        if whole != 1.0:
            return inline
    shift = table_shift(q_lo, q_hi, k_lo, k_hi)
    q_lo, q_hi, k_lo, k_hi = q_lo - shift, q_hi - shift, k_lo - shift, k_hi - shift
    # a masked load reads position 0 (rows and keys past a tile's end): its distances to the
    # real positions, 0 - pos_j and pos_i - 0, are in the table too
    bottom, top = min(q_lo, 0.0) - max(k_hi, 0.0), max(q_hi, 0.0) - min(k_lo, 0.0)
    if (top - bottom + 1 > POSITION_TABLE_SPAN * (pos_q.shape[2] + pos_k.shape[2])
            or max(abs(q_lo), abs(q_hi), abs(k_lo), abs(k_hi)) > MAX_POSITION):
        return inline
    moved = tuple((p - shift).contiguous() for p in pos)
    return PositionCall(table_prior, moved, (int(bottom), int(top)))


def decided(prior, pos, position_grads, extent=None) -> PositionCall:
    """pos as a PositionCall: as the caller decided it (the autograd Function decides once, for
    the forward and its backward: autograd.decide_positions), else decided here."""
    if isinstance(pos, PositionCall):
        return pos
    return position_call(prior, pos, position_grads, extent)


def table_shift(q_lo, q_hi, k_lo, k_hi) -> float:
    """The integer subtracted from every position of a table call (d is blind to it): one in
    both ranges where the queries' and the keys' positions overlap, so that the masked loads'
    0 adds no distance the real ones do not span (0 - pos_j and pos_i - 0 are then distances
    of real pairs' range), else the keys' smallest."""
    lo, hi = max(q_lo, k_lo), min(q_hi, k_hi)
    return lo if lo <= hi else k_lo


def base2_log_prior(table):
    """The table with its log-prior slot (0) in base-2 units, log2(e) * log_prior: the kernels'
    softmax runs in base 2, so a logit is then one fused multiply-add, q.k * scale * log2(e) +
    entry (_table_logit2). The derivative slots stay in nats (they meet dS, which is)."""
    scaled = table.clone()
    scaled[:, 0] = (table[:, 0].double() * LOG2E).to(table.dtype)
    return scaled


def prior_window(prior, table, d_top):
    """Block skipping: per head, the smallest and largest distance whose log-prior (table slot
    0) is above the skip bound, as int32 [Hq, 2]; (2**30, -2**30) when none is."""
    if prior.traits.skip is None:
        return table    # no skipping: the kernels take the argument and ignore it
    # the bound in the table's unit: base 2 where the logit is s + log_prior (base2_log_prior)
    unit = LOG2E if prior.traits.score_is_s else 1.0
    values = table[:, 0, :]
    distance = d_top - torch.arange(values.shape[1], device=values.device, dtype=torch.int64)
    keep = values > prior.traits.skip * unit
    lo = torch.where(keep, distance, 2 ** 30).amin(1)
    hi = torch.where(keep, distance, -2 ** 30).amax(1)
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


def row_abs_flag(shifted):
    """The kernels' row_abs: the statistics absolute (1.0) for unshifted calls (forward_block and
    backward_block, whose blocks are merged), else relative to each row's reference where the
    prior is a causal ramp (0.0; see triton_forward.py.jinja)."""
    return 0.0 if shifted else 1.0


def tune_key(q, Nq, Nk, causal):
    """The autotuner's key: dtype, causal and the length bucket (None for a traced call's
    symbolic lengths, which a trace cannot tune for)."""
    if not (isinstance(Nq, int) and isinstance(Nk, int)):
        return (str(q.dtype), causal, None)
    return (str(q.dtype), causal, 1 << (max(Nq, Nk) - 1).bit_length())


class KernelLayout:
    """The layout arguments as the kernels take them: the scalar offsets and the constexpr flags,
    with the tensors behind them (placeholders, never read, where a flag is off): key_mask as
    bytes [B, Nk], per-row offsets as int32 [B], cu_seqlens as int32, and for packed documents
    the work lists of (document, tile) items, built per tile size on first use."""

    def __init__(self, q, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k, pos=None):
        # (empty, not zeros: a placeholder is never read, and zeros would launch a fill kernel
        # a call, a launch's host time that the call pays before its kernels run)
        placeholder = torch.empty(2, device=q.device, dtype=torch.int32)
        # position tensors: [B, Hq, N, C] float32, contiguous (docs/positions.md)
        self.positions = pos is not None
        if self.positions:
            self.pos_q, self.pos_k = (p.to(torch.float32).contiguous() for p in pos)
        else:
            self.pos_q = self.pos_k = torch.empty(2, device=q.device, dtype=torch.float32)
        self.row_offsets = isinstance(q_offset, torch.Tensor) or isinstance(k_offset, torch.Tensor)
        if self.row_offsets:
            self.q_off = torch.as_tensor(q_offset, device=q.device).to(torch.int32).expand(q.shape[0]).contiguous()
            self.k_off = torch.as_tensor(k_offset, device=q.device).to(torch.int32).expand(q.shape[0]).contiguous()
            self.q_offset, self.k_offset = 0, 0
        else:
            self.q_off = self.k_off = placeholder
            self.q_offset, self.k_offset = q_offset, k_offset
        self.has_key_mask = key_mask is not None
        # a copy, not .view(torch.uint8): torch 2.11's inductor cannot lower a bool tensor's
        # dtype view on CUDA (docs/architecture.md, "Custom ops")
        self.key_mask = key_mask.to(torch.uint8).contiguous() if self.has_key_mask else placeholder
        self.stride_mb = key_mask.shape[1] if self.has_key_mask else 0
        self.varlen = cu_seqlens_q is not None
        if self.varlen:
            self.cu_q = cu_seqlens_q.to(torch.int32).contiguous()
            self.cu_k = cu_seqlens_k.to(torch.int32).contiguous()
            self._cu = (cu_seqlens_q, cu_seqlens_k)
        else:
            self.cu_q = self.cu_k = placeholder
        self._work = {}
        self._placeholder = placeholder

    def work(self, side, block):
        """int32 [items, 2] of (document, tile) for the documents' query (side 0) or key (side 1)
        tiles of `block` rows; the placeholder without packed documents. Made once a call (a
        launch asks twice: its grid and its pointers), and within host_reads.kept() once while
        cu_seqlens is unchanged (every layer of a model passes the same one)."""
        if not self.varlen:
            return self._placeholder
        if (side, block) not in self._work:
            self._work[side, block] = HOST_READS.read(work_items, self._cu[side], block)
        return self._work[side, block]

    def grid0(self, side, block, count):
        """Programs along the grid's first axis: the work items, or the tiles of count rows."""
        return self.work(side, block).shape[0] if self.varlen else triton.cdiv(count, block)

    def pointers(self, side, block):
        return (self.key_mask, self.q_off, self.k_off, self.cu_q, self.cu_k, self.work(side, block))

    @property
    def masked(self):
        return self.has_key_mask or self.row_offsets or self.varlen

    def flags(self):
        return dict(HAS_KEY_MASK=self.has_key_mask, ROW_OFFSETS=self.row_offsets, VARLEN=self.varlen)


def work_items(cu_seqlens, block):
    """int32 [items, 2] on cu_seqlens' device: (document, tile) for every tile of `block` rows
    of every document, in order."""
    bounds = torch.tensor(HOST_READS.read(values, cu_seqlens), dtype=torch.int64)   # (host)
    tiles = (bounds[1:] - bounds[:-1] + block - 1) // block            # per document
    doc = torch.repeat_interleave(torch.arange(tiles.numel()), tiles)
    first = torch.cumsum(tiles, 0) - tiles                             # each document's first item
    tile = torch.arange(doc.numel()) - first[doc]
    return torch.stack([doc, tile], 1).to(device=cu_seqlens.device, dtype=torch.int32).contiguous()


def eager_kernel(kernel):
    """How an eager call launches a kernel: as it is."""
    return kernel


def traced_kernel(kernel):
    """How a triton op (api: _TritonOps) launches a kernel: through torch.library.wrap_triton,
    which under torch.compile records the launch in the graph, where inductor sees it, and
    launches it as it is otherwise. Under TRITON_INTERPRET=1 the ops are opaque custom ops
    (ops.TritonOps), so an interpreted kernel (not a JITFunction) launches as it is: torch
    2.13's wrap_triton passes it through, torch 2.11's refuses it."""
    if interpreting():
        return kernel
    return torch.library.wrap_triton(kernel)


class SkippedLaunch:
    """A launcher that launches nothing: the triton ops' fake implementation under
    TRITON_INTERPRET=1 runs their host code (every shape, guard and allocation) without the
    interpreted kernels, which cannot take fake tensors."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def skipped_kernel(kernel):
    return SkippedLaunch()


TABLE_WARPS = 4
TABLE_CHUNK = 2048   # entries per program of the table kernels


def table_block(slots: int) -> int:
    """Distances per step of the table kernels: each thread holds its distances' entries in
    float64, so a prior of many slots (T5's 33) takes fewer at a time, or it spills. The
    interpreter, whose cost is per operation rather than per entry, takes a program's whole
    chunk in one step (T5's table tests: 21 s each at 128)."""
    if interpreting():
        return TABLE_CHUNK
    return 512 if slots <= 8 else 128


def distance_table(prior, theta, bottom, top, causal, with_grads, shifted, wrap=eager_kernel):
    """The call's distance table as the kernels read it: tables.prior_tables's, with the value
    slot in base 2 where the logit is s + log_prior (base2_log_prior). For CUDA tensors, built
    on the device in two launches by the table kernels (table.py) where the prior has a float64
    Triton form (its prior_distance hook), else by torch (about 40 launches on a GPU). Returns
    (table, d_top). wrap: how the kernel is launched (eager_kernel; launches.py counts).

    On CPU tensors (the interpreter) torch builds it: launches cost nothing there, and the
    interpreted kernels took 0.1 s a call for GGD and 1 s for T5, 25-500x torch's build.
    pinned(table="device") takes the kernels there too (tests/runtime/test_table_kernel.py
    holds them to torch's build), pinned(table="host") torch's build on a GPU
    (benchmarks/gpu.py's @table=host peers)."""
    pin = _PINS.get().table
    kernels = pin == "device" or (pin is None and theta.is_cuda)
    if "prior_distance" not in prior.triton_hooks or not kernels:
        table, d_top = prior_tables(prior, theta, bottom, top, causal, with_grads, shifted)
        return (base2_log_prior(table) if prior.traits.score_is_s else table), d_top
    Hq = theta.shape[0]
    d_top = top + TABLE_PAD
    n_dist = top - bottom + 1 + 2 * TABLE_PAD
    slots = 1 + len(prior.traits.table_grads) * bool(with_grads)
    table = theta.new_empty((Hq, slots, n_dist))
    lo, hi = (max(bottom, 0), top) if causal else (bottom, top)   # distances a query may see
    shift = bool(shifted and lo <= hi)
    t_lo, t_hi = d_top - hi, d_top - lo
    parts = triton.cdiv(t_hi - t_lo + 1, TABLE_CHUNK) if shift else 1
    best = theta.new_empty((Hq, parts), dtype=torch.float64)
    best_t, nan = (theta.new_empty((Hq, parts), dtype=torch.int32) for _ in range(2))
    theta = theta.contiguous()
    kernels, block = prior.kernels(), table_block(slots)
    options = dict(num_warps=TABLE_WARPS, enable_fp_fusion=FP_FUSION)   # (torch fuses nothing)
    if shift:
        wrap(kernels["table_shift"])[(Hq, parts)](
            theta, theta.stride(0), best, best_t, nan, d_top, t_lo, t_hi, parts,
            CHUNK=TABLE_CHUNK, BLOCK=block, **options)
    wrap(kernels["table"])[(Hq, triton.cdiv(n_dist, TABLE_CHUNK))](
        theta, theta.stride(0), table, table.stride(0), table.stride(1), best, best_t, nan, parts,
        d_top, n_dist, t_lo, SLOTS=slots, SHIFT=shift, BASE2=prior.traits.score_is_s,
        CHUNK=TABLE_CHUNK, BLOCK=block, **options)
    return table, d_top


def forward(prior, q, k, v, theta, causal, scale, q_offset, k_offset, for_backward=False,
            shifted=True, n=None, key_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, pos=None,
            position_grads=True):
    """Launch the forward kernel. Returns (out, stats, out32, table): stats [2, B, Hq, Nq]
    float32 holds the softmax's per-row max (base 2) and sum; out32 is O in float32 when a
    backward will follow a low-precision input, else out itself; table is the prior's table
    (table strategy), built with its derivative slots when a backward will follow.

    The backward reuses this table rather than building its own (the same values by
    construction, one build per step). shifted: see tables.prior_tables; n: see _row_key_counts.
    key_mask, cu_seqlens_q/k and tensor offsets: as _layout() normalised them. pos: position
    tensors (pos_q, pos_k) [B, Hq, N, C] (docs/positions.md), taken by prior.positional's
    kernels (offsets 0; packed documents taken), or at integer positions that need no gradient
    (position_grads False) by the prior's table (position_call); the default, position_grads
    True (the block API's and the ring's calls), is always the inline kernels. pos may be the
    PositionCall already decided (autograd.decide_positions)."""
    span = None
    if pos is not None:
        call = decided(prior, pos, position_grads)
        prior, pos, span = call.prior, call.pos, call.span
    table, d_top, window, counts = prior_inputs(prior, q, k, theta, q_offset, k_offset, causal, for_backward,
                                                shifted, None, n, key_mask, cu_seqlens_q, cu_seqlens_k,
                                                span)
    lay = KernelLayout(q, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k, pos)
    out, stats, out32 = forward_kernels(prior, q, k, v, theta, causal, scale, table, d_top, window,
                                        counts, lay, for_backward, shifted)
    return out, stats, out32, table


def table_args(prior, table, d_top):
    """The kernels' (d_top_b, tab_slot, tab_stride_h) for a table (TABLE_ROW_ARGS)."""
    if not prior.traits.table:
        return 0, 0, 0   # (the inline strategy takes the arguments and ignores them)
    return d_top + TABLE_ROW_BIAS, table.shape[2], table.shape[1] * table.shape[2]


def forward_kernels(prior, q, k, v, theta, causal, scale, table, d_top, window, counts, lay,
                    for_backward, shifted, wrap=eager_kernel):
    """The forward's launches, given the prior's table, window and key counts (out, stats,
    out32 as _triton_forward returns them). wrap: how a kernel is launched (traced_kernel in
    the triton ops: no host code here reads a tensor's values, so a trace goes through)."""
    kernels = prior.kernels()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    D = int(D)   # (a constexpr: a traced call specialises on the head dim)
    out = torch.empty_like(q)
    store_o32 = for_backward and q.dtype != torch.float32
    out32 = torch.empty(q.shape, device=q.device, dtype=torch.float32) if store_o32 else out
    stats = torch.empty(2, B, Hq, Nq, device=q.device, dtype=torch.float32)
    d_top_b, tab_slot, tab_stride_h = table_args(prior, table, d_top)
    if not for_backward and not lay.varlen and not lay.positions and Nq <= DECODE_ROWS:
        decode(prior, q, k, v, theta, causal, scale, out, stats, table, d_top_b, tab_slot,
               tab_stride_h, window, counts, lay, shifted, wrap)
        return out, stats, out32

    gather = table_gather(q.device, head_dim_padded(D))
    traced = wrap is not eager_kernel
    tma = kv_tma(prior, q, k, v, lay, traced)

    def run(config):
        block_m, block_n, warps, stages = config
        k_in, v_in = kv_descriptors(k, v, block_n, head_dim_padded(D)) if tma else (k, v)
        return wrap(kernels["fwd"])[(lay.grid0(0, block_m, Nq), B * Hq)](
            q, k_in, v_in, theta, out, out32, stats[0], stats[1], table, window, counts,
            *lay.pointers(0, block_m), lay.pos_q, lay.pos_k,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            Hq, Hq // Hk, Nq, Nk, lay.q_offset, lay.k_offset, scale, d_top_b, tab_slot, tab_stride_h,
            counts.stride(0), lay.stride_mb, row_abs_flag(shifted),
            NUM_PARAMS=theta.shape[1], CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
            HEAD_DIM=head_dim_padded(D), D=D, DOT_PREC=dot_precision(q.dtype),
            UPCAST_DOT=upcast_dot(q.dtype), STORE_O32=store_o32, **lay.flags(),
            TABLE_GATHER=gather, KV_TMA=tma, num_warps=warps, num_stages=stages,
            enable_fp_fusion=FP_FUSION)

    launch(prior, "fwd", D, q.device, tune_key(q, Nq, Nk, causal), run, lay.masked, traced, tma)
    return out, stats, out32


def decode_splits(Nk, programs, block_n, sms):
    """(keys per split, splits) of a decode call with `programs` (batch, head) pairs on a GPU of
    `sms` SMs (None: the interpreter): enough splits for DECODE_WAVES programs per SM, each of
    at least DECODE_MIN_KEYS keys (a multiple of block_n), at most DECODE_MAX_SPLITS splits.
    (bamgen.aot's decode model calls it too, with the SMs of the GPU it models.) Sizes may be
    symbolic (a traced call): torch.sym_max keeps a growing cache from adding guards."""
    cdiv = lambda a, b: -(-a // b)   # noqa: E731
    if sms is None:
        keys = DECODE_INTERPRET_KEYS
    else:
        keys = torch.sym_max(DECODE_MIN_KEYS, cdiv(Nk, cdiv(DECODE_WAVES * sms, programs)))
    keys = cdiv(torch.sym_max(keys, cdiv(Nk, DECODE_MAX_SPLITS)), block_n) * block_n
    return keys, torch.sym_max(1, cdiv(Nk, keys))


def decode(prior, q, k, v, theta, causal, scale, out, stats, table, d_top_b, tab_slot, tab_stride_h,
           window, counts, lay, shifted, wrap=eager_kernel):
    """The forward of a call with at most DECODE_ROWS query rows and no backward to follow
    (flash-decoding): the keys split over programs (_attn_decode), the splits' partials merged
    by log-sum-exp (_decode_combine) into out and stats, as _triton_forward documents them."""
    kernels = prior.kernels()
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    D = int(D)
    head_dim = head_dim_padded(D)
    sms = None if interpreting() else torch.cuda.get_device_properties(q.device).multi_processor_count
    gather = table_gather()
    traced = wrap is not eager_kernel
    tma = kv_tma(prior, q, k, v, lay, traced, "decode")

    def run(config):
        block_m, block_n, warps, stages = config
        k_in, v_in = kv_descriptors(k, v, block_n, head_dim) if tma else (k, v)
        keys, splits = decode_splits(Nk, B * Hq, block_n, sms)
        # (a traced call: the merge's width is fixed, not a guard on the number of splits)
        block_s = triton.next_power_of_2(splits) if isinstance(splits, int) else DECODE_MAX_SPLITS
        part_o = torch.empty(splits, B * Hq, Nq, head_dim, device=q.device, dtype=torch.float32)
        part_m = torch.empty(splits, B * Hq, Nq, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        compiled = wrap(kernels["decode"])[(splits, B * Hq)](
            q, k_in, v_in, theta, part_o, part_m, part_l, table, window, counts, lay.key_mask,
            lay.q_off, lay.k_off,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            Hq, Hq // Hk, Nq, Nk, lay.q_offset, lay.k_offset, scale, d_top_b, tab_slot, tab_stride_h,
            counts.stride(0), lay.stride_mb, row_abs_flag(shifted), keys,
            NUM_PARAMS=theta.shape[1], CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
            HEAD_DIM=head_dim, D=D, DOT_PREC=dot_precision(q.dtype), UPCAST_DOT=upcast_dot(q.dtype),
            HAS_KEY_MASK=lay.has_key_mask, ROW_OFFSETS=lay.row_offsets, TABLE_GATHER=gather,
            KV_TMA=tma, num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)
        wrap(kernels["combine"])[(Nq, B * Hq)](
            part_o, part_m, part_l, out, stats[0], stats[1], out.stride(0), out.stride(1),
            out.stride(2), Hq, Nq, splits, BLOCK_S=block_s,
            HEAD_DIM=head_dim, D=D, num_warps=COMBINE_WARPS, num_stages=1)
        return compiled

    launch(prior, "decode", D, q.device, tune_key(q, Nq, Nk, causal), run, lay.masked, traced, tma)


def backward(prior, dout, q, k, v, out, stats, out32, table, theta, causal, scale, q_offset,
             k_offset, row_sums=False, shifted=True, n=None, key_mask=None, cu_seqlens_q=None,
             cu_seqlens_k=None, pos=None, position_grads=True):
    """Launch preprocess, dK/dV and dQ kernels. Returns dq, dk, dv, dparams [Hq, NUM_GRADS];
    with row_sums (backward_block), dparams without the row correction and the row sums
    [B, Hq, Nq, 1 + NUM_GRADS] that it needs; with pos (forward's), then the positions'
    gradients, float32 [B, Hq, N, C] each (with row_sums, pos_q's without its row correction:
    one block's share, which adds up over the blocks; zeros where position_grads is False and
    the forward read the table at integer positions: position_call decides as it did for the
    forward, or takes the forward's PositionCall as pos; the default, True, is always the
    inline kernels)."""
    span = None
    if pos is not None:
        call = decided(prior, pos, position_grads)
        prior, pos, span = call.prior, call.pos, call.span
    table, d_top, window, counts = prior_inputs(prior, q, k, theta, q_offset, k_offset, causal, True, shifted,
                                                table, n, key_mask, cu_seqlens_q, cu_seqlens_k, span)
    lay = KernelLayout(q, q_offset, k_offset, key_mask, cu_seqlens_q, cu_seqlens_k, pos)
    return backward_kernels(prior, dout, q, k, v, out32, stats, theta, causal, scale, table, d_top,
                            window, counts, lay, row_sums, shifted)


def backward_kernels(prior, dout, q, k, v, out32, stats, theta, causal, scale, table, d_top, window,
                     counts, lay, row_sums, shifted, wrap=eager_kernel):
    """The backward's launches, given the prior's table (with its derivative slots), window and
    key counts; wrap: as _triton_forward_kernels'."""
    kernels = prior.kernels()
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    if lay.has_key_mask or lay.varlen:
        # padding queries see no key (l = 0): read as 0, their dS is 0 and 0 * NaN (a NaN stored
        # in a padding slot) would reach every key's dK and dV through the MMA
        dead = (stats[1] == 0)[..., None]
        q, dout = q.masked_fill(dead, 0.0), dout.masked_fill(dead, 0.0)
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    D = int(D)
    head_dim = head_dim_padded(D)
    precision, upcast = dot_precision(q.dtype), upcast_dot(q.dtype)
    num_params = theta.shape[1]
    key = tune_key(q, Nq, Nk, causal)
    d_top_b, tab_slot, tab_stride_h = table_args(prior, table, d_top)
    delta = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
    # each row's m and 1/l as the dK/dV kernel reads them (see _bwd_preprocess); the kernels of
    # positions as tensors read the forward's m and l instead (traits.rows_ready, ROWS_READY).
    # Two tensors, not two views of one: views of one buffer written by one launch made AOT
    # autograd specialise the length (tests/runtime/test_compile.py).
    forward_rows = (stats[0], stats[1])
    ready = tuple(torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
                  for _ in range(2)) if prior.traits.rows_ready else None
    if prior.traits.row_cache:
        # each row's (log2(e) * logit factor, d logit / d s) for dK/dV (see _bwd_preprocess)
        row_f = torch.empty(B, Hq, Nq, 2, device=q.device, dtype=torch.float32)
    else:
        row_f = delta   # (a placeholder the kernels do not touch)
    rows, warps = PREPROCESS
    wrap(kernels["preprocess"])[(triton.cdiv(Nq, rows), B * Hq)](
        out32, dout, *forward_rows, delta, *(ready or (delta, delta)), theta, counts, row_f,
        out32.stride(0), out32.stride(1), out32.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), counts.stride(0), Hq, Nq,
        NUM_PARAMS=num_params, BLOCK_M=rows, HEAD_DIM=head_dim, D=D, num_warps=warps, num_stages=1)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    # the positions' gradients (POSITIONS: every row and key is written; placeholders otherwise,
    # never read or written, so without a fill)
    dpos_q, dpos_k = ((torch.zeros_like if lay.positions else torch.empty_like)(p)
                      for p in (lay.pos_q, lay.pos_k))

    dkdv_split = split_steady(prior, "bwd_dkdv", q.device, head_dim)

    def run_dkdv(config):
        block_m, block_n, warps, stages = config
        return wrap(kernels["bwd_dkdv"])[(lay.grid0(1, block_n, Nk), B * Hk)](
            q, k, v, theta, dout, *(ready or forward_rows), delta, row_f, dk, dv, table, window, counts,
            *lay.pointers(1, block_n), lay.pos_q, lay.pos_k, dpos_k,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            Hq, Hk, Hq // Hk, Nq, Nk, lay.q_offset, lay.k_offset, scale, d_top_b, tab_slot, tab_stride_h,
            counts.stride(0), lay.stride_mb, row_abs_flag(shifted),
            NUM_PARAMS=num_params, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
            HEAD_DIM=head_dim, D=D, DOT_PREC=precision, UPCAST_DOT=upcast, **lay.flags(),
            SPLIT_STEADY=dkdv_split, num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)

    launch(prior, "bwd_dkdv", D, q.device, key, run_dkdv, lay.masked, wrap is not eager_kernel)
    dist_sums = prior.traits.dist_sums and not row_sums
    if prior.traits.table_width and not dist_sums:
        # the dQ kernel reads the log-prior and its derivatives together: interleaved per distance
        table_dq = interleaved_table(table, prior.traits.table_width)
        dq_stride_h = table_dq.shape[1] * table_dq.shape[2]
    else:
        table_dq, dq_stride_h = table, tab_stride_h
    groups = [(0, 0)] if dist_sums else grad_groups(
        prior.traits.num_grads, prior.traits.tile_kind,
        _PINS.get().dq_group or (INTERPRET_GRAD_GROUP if interpreting() and interpreted_family() is None
                                 else None), lay.masked)
    dq = torch.empty_like(q)
    partials = {}   # one partial sum per dQ program: its shape follows the tile
    dq_split = split_steady(prior, "bwd_dq", q.device, head_dim)

    def run_dq(config):
        block_m, block_n, warps, stages = config
        m_blocks = lay.grid0(0, block_m, Nq)
        partials["sums"] = torch.zeros(B * m_blocks, Hq, max(prior.traits.num_grads, 1),
                                       device=q.device, dtype=torch.float32)
        if isinstance(m_blocks, int) and m_blocks == 0:   # (packed documents with no query)
            return None
        out = None
        for base, count in groups:
            out = wrap(kernels["bwd_dq"])[(m_blocks, B * Hq)](
                q, k, v, theta, dout, stats[0], stats[1], delta, dq, partials["sums"], rows, table_dq,
                window, counts, *lay.pointers(0, block_m), lay.pos_q, lay.pos_k, dpos_q,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                Hq, Hq // Hk, Nq, Nk, lay.q_offset, lay.k_offset, scale, d_top_b, tab_slot, dq_stride_h,
                counts.stride(0), lay.stride_mb, row_abs_flag(shifted),
                NUM_PARAMS=num_params, NUM_GRADS=prior.traits.num_grads, GRAD_BASE=base,
                GRAD_COUNT=count, DIST_SUMS=dist_sums, DIST_K=dist_width(prior.traits.num_grads),
                CAUSAL=causal, BLOCK_M=block_m,
                BLOCK_N=block_n, HEAD_DIM=head_dim, D=D, DOT_PREC=precision, UPCAST_DOT=upcast,
                ROW_SUMS=row_sums, **lay.flags(), SPLIT_STEADY=dq_split, num_warps=warps,
                num_stages=stages, enable_fp_fusion=FP_FUSION)
        return out

    if row_sums:
        rows = torch.zeros(B, Hq, Nq, 1 + prior.traits.num_grads, device=q.device, dtype=torch.float32)
    elif len(groups) > 1:   # each row's sum of dS, from the first group's launch to the others'
        rows = torch.empty_like(delta)
    else:
        rows = delta   # (a placeholder the kernel does not touch)
    launch(prior, "bwd_dq", D, q.device, key, run_dq, lay.masked, wrap is not eager_kernel)
    dparams = partials["sums"].sum(0)[:, :prior.traits.num_grads]
    found = (dq, dk, dv, dparams, rows) if row_sums else (dq, dk, dv, dparams)
    if lay.positions and lay.has_key_mask:
        # a padding key's position gradient: 0, as its dK and dV. The dK/dV kernel sums its
        # scores as any key's (it zeroes dK and dV after its loop); a select on its position
        # sums there put 16 bytes of ALiBi's packed kernel on sm_80's stack
        dpos_k.masked_fill_(lay.key_mask[:, None, :, None] == 0, 0.0)
    return (*found, dpos_q, dpos_k) if lay.positions else found


# Learnable scalars one dQ launch sums (GRAD_BASE, GRAD_COUNT in backward.py), unless the
# prior's tile kind says otherwise (tiles.GRAD_GROUPS, GRAD_GROUPS_MASKED): a prior with more
# takes a launch per group, each with the registers of a few accumulators (FIRE's 99 in one
# launch would need 198 of them per row, and spill); every group recomputes P and dS, and the
# first also writes dQ.
GRAD_GROUP = 8
# Under TRITON_INTERPRET=1 (and no BAMGEN_INTERPRET_TILES) a dQ launch sums up to this many:
# the interpreter's time goes by launches, not registers (FIRE's 134 scalars of a two-head
# test, 4 a launch, took 33 s a backward; 16 a launch, 11 s). FIRE still takes several
# launches, the last one ragged, so the tests run the multi-launch path;
# tests/runtime/test_library.py also runs GGD a scalar a launch.
INTERPRET_GRAD_GROUP = 16


def dist_width(num_grads: int) -> int:
    """The per-distance sums' columns (DIST_K): a power of two >= the learnable scalars."""
    return triton.next_power_of_2(max(num_grads, 1))


def grad_groups(num_grads: int, kind: str = "", size: int | None = None,
                masked: bool = False) -> list[tuple[int, int]]:
    """(first learnable scalar, how many) of each dQ launch: one launch for up to the group
    size of the prior's tile kind, masked or not (or `size`, for a benchmark that tries others)."""
    size = size or (masked and GRAD_GROUPS_MASKED.get(kind)) or GRAD_GROUPS.get(kind, GRAD_GROUP)
    if num_grads <= size:
        return [(0, num_grads)]
    return [(base, min(size, num_grads - base)) for base in range(0, num_grads, size)]


def interleaved_table(table, width):
    """The dQ kernel's table: [Hq, entries, width], a distance's log-prior and derivatives side
    by side (zero-padded to whole groups of four) from the [Hq, slots, entries] table, so that
    one 16-byte load gathers them (table_load4)."""
    return torch.nn.functional.pad(table.transpose(1, 2), (0, width - table.shape[1])).contiguous()


def kernel_specs(prior, dtype="bf16", head_dim=64, causal=True, arch="sm_90", candidate=0,
                 layout="plain"):
    """Each Triton kernel with the signature and constexprs of one specialisation, for
    ahead-of-time compilation (``bamgen inspect`` and the AOT tests): a list of
    (name, jit function, signature, constexprs, num_warps, num_stages). `candidate` picks a
    tile config from the family's TRITON_CONFIG list (clamped to the list's length). layout:
    "plain" (no masks), "padded" (key_mask and per-row offsets: batched generation),
    "packed" (packed documents and key_mask), "positions" (position tensors: the kernels of
    prior.positional, which a prior over several channels is itself; no decode kernels),
    "positions_packed" (position tensors with packed documents and key_mask), or
    "positions_table" / "positions_table_packed" (integer position tensors read by a table prior:
    the kernels of prior.position_table, position_call)."""
    if layout.startswith("positions_table"):
        if getattr(prior, "position_table", None) is None:
            raise ValueError(f"--layout {layout}: the prior {prior.traits.name!r} reads no distance "
                             f"table at integer positions (a table prior in d alone, score "
                             f"s + log_prior, does); use --layout positions")
        prior = prior.position_table
        layout = layout.replace("_table", "")
    positional = layout in ("positions", "positions_packed") or prior.traits.tensor_positions
    if positional:
        prior = prior.positional
    kernels = prior.kernels()
    ptr = "*" + dtype
    padded = head_dim_padded(head_dim)
    precision = "ieee" if dtype == "fp32" else "tf32"

    specs = []
    # K and V through TMA where a launch of this layout would read them so (kv_tma: no mask
    # of any kind, 16-bit inputs, rows a multiple of 16 bytes)
    tma = lambda kernel: (reads_kv_through_tma(kernel, prior.traits.tile_kind, arch, padded)  # noqa: E731
                          and layout in ("plain", "positions") and dtype in ("bf16", "fp16")
                          and head_dim % 8 == 0)
    flags = {"plain": (False, False, False), "padded": (True, True, False),
             "packed": (True, False, True), "positions": (False, False, False),
             "positions_packed": (True, False, True)}[layout]
    common = dict(NUM_PARAMS=prior.traits.num_columns, CAUSAL=causal, HEAD_DIM=padded, D=head_dim,
                  DOT_PREC=precision, UPCAST_DOT=False,
                  **dict(zip(("HAS_KEY_MASK", "ROW_OFFSETS", "VARLEN"), flags)))
    layout_ptrs = dict(KeyMask="*u8", QOff="*i32", KOff="*i32", CuSeqQ="*i32", CuSeqK="*i32",
                       Work="*i32")
    pos_ptrs = dict(PosQ="*fp32", PosK="*fp32")
    plans = [
        ("attn_fwd", kernels["fwd"], "fwd",
         dict(Q=ptr, K=ptr, V=ptr, Theta="*fp32", O=ptr, O32="*fp32", Mrow="*fp32", Lrow="*fp32",
              Table="*fp32", Window="*i32", NRow="*fp32", **layout_ptrs, **pos_ptrs),
         dict(STORE_O32=dtype != "fp32", TABLE_GATHER=fwd_table_gather(arch, padded),
              KV_TMA=tma("fwd"))),
        ("bwd_preprocess", kernels["preprocess"], None,
         dict(O=ptr if dtype == "fp32" else "*fp32", DO=ptr, Mrow="*fp32", Lrow="*fp32",
              Delta="*fp32", RowM="*fp32", RowInvL="*fp32", Theta="*fp32", NRow="*fp32",
              RowF="*fp32"), None),
        ("attn_bwd_dkdv", kernels["bwd_dkdv"], "bwd_dkdv",
         dict(Q=ptr, K=ptr, V=ptr, Theta="*fp32", DO=ptr, RowM="*fp32", RowL="*fp32", Delta="*fp32",
              RowF="*fp32", DK=ptr, DV=ptr, Table="*fp32", Window="*i32", NRow="*fp32", **layout_ptrs,
              **pos_ptrs, DPosK="*fp32"),
         dict(SPLIT_STEADY=splits_steady("bwd_dkdv", prior.traits.tile_kind, arch, padded))),
        ("attn_bwd_dq", kernels["bwd_dq"], "bwd_dq",
         dict(Q=ptr, K=ptr, V=ptr, Theta="*fp32", DO=ptr, Mrow="*fp32", Lrow="*fp32", Delta="*fp32",
              DQ=ptr, DTheta="*fp32", RowSums="*fp32", Table="*fp32", Window="*i32", NRow="*fp32",
              **layout_ptrs, **pos_ptrs, DPosQ="*fp32"),
         # (the first group's launch: the one that also writes dQ)
         dict(NUM_GRADS=prior.traits.num_grads, GRAD_BASE=0,
              GRAD_COUNT=0 if prior.traits.dist_sums
              else grad_groups(prior.traits.num_grads, prior.traits.tile_kind,
                               masked=any(flags))[0][1],
              DIST_SUMS=prior.traits.dist_sums, DIST_K=dist_width(prior.traits.num_grads),
              ROW_SUMS=False,
              SPLIT_STEADY=splits_steady("bwd_dq", prior.traits.tile_kind, arch, padded))),
    ]
    if layout in ("plain", "padded") and not positional:   # (else: the prefill kernels alone)
        plans += [
            ("attn_decode", kernels["decode"], "decode",
             dict(Q=ptr, K=ptr, V=ptr, Theta="*fp32", PartO="*fp32", PartM="*fp32", PartL="*fp32",
                  Table="*fp32", Window="*i32", NRow="*fp32", **layout_ptrs),
             dict(TABLE_GATHER=FWD_TABLE_GATHER, KV_TMA=tma("decode"))),
            ("decode_combine", kernels["combine"], None,
             dict(PartO="*fp32", PartM="*fp32", PartL="*fp32", O=ptr, Mrow="*fp32", Lrow="*fp32"),
             None),
        ]
    # (distance_table's kernels, the same in every layout: compiled with the plain one)
    if prior.traits.table and "prior_distance" in prior.triton_hooks and layout == "plain":
        slots = 1 + len(prior.traits.table_grads)
        parts = dict(Best="*fp64", BestT="*i32", Nan="*i32")
        plans += [("table_shift", kernels["table_shift"], None, dict(Theta="*fp32", **parts),
                   dict(CHUNK=TABLE_CHUNK, BLOCK=table_block(slots))),
                  ("distance_table", kernels["table"], None, dict(Theta="*fp32", Out="*fp32", **parts),
                   dict(SLOTS=slots, SHIFT=True, BASE2=prior.traits.score_is_s, CHUNK=TABLE_CHUNK,
                        BLOCK=table_block(slots)))]
    # extra: None for the preprocess and combine kernels (no prior, no key tiles), else the
    # kernel's own constexprs
    for name, fn, config, pointers, extra in plans:
        if name in ("table_shift", "distance_table"):   # programs of CHUNK entries, no tiles
            block_m, block_n, warps, stages = None, None, TABLE_WARPS, 1
        elif name == "decode_combine":   # the merge, compiled for DECODE_COMBINE_SPLITS splits
            block_m, block_n, warps, stages = None, None, COMBINE_WARPS, 1
        elif extra is None:   # the preprocess kernel: Triton's default launch settings
            block_m, block_n, warps, stages = PREPROCESS[0], None, PREPROCESS[1], 1
        else:
            options = candidates(prior, config, head_dim, arch, layout not in ("plain", "positions"),
                                 tma=extra.get("KV_TMA", False))
            block_m, block_n, warps, stages = options[min(candidate, len(options) - 1)]
        constexprs = {"BLOCK_M": block_m, "BLOCK_S": DECODE_COMBINE_SPLITS, "HEAD_DIM": padded,
                      "D": head_dim, "NUM_PARAMS": prior.traits.num_columns}
        if extra is not None:
            constexprs.update(common, BLOCK_N=block_n, **extra)
        constexprs = {key: value for key, value in constexprs.items() if key in fn.arg_names}
        sig = {}
        for arg in fn.arg_names:
            if constexprs.get("KV_TMA") and arg in ("K", "V"):
                sig[arg] = kv_descriptor_type(dtype, block_n, padded)
            elif arg in pointers:
                sig[arg] = pointers[arg]
            elif arg in constexprs:
                sig[arg] = "constexpr"
            elif arg in ("sm_scale", "row_abs"):
                sig[arg] = "fp32"
            else:
                sig[arg] = "i32"
        specs.append((name, fn, sig, constexprs, warps, stages))
    return specs
