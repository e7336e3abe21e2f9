"""Tile configurations of the Triton kernels, per kind of prior, GPU family and head dim.

A config is (BLOCK_M, BLOCK_N, num_warps, num_stages); each kernel has a list of candidates,
the first the default (``BAMGEN_AUTOTUNE=1`` times them all on a GPU). A prior's traits name
its kind (``PriorTraits.tile_kind``, chosen by the compiler: ``bamgen/compiler/tiles.py``). Register pressure decides the tiles,
and it depends on what the main loop computes per score:

* ``light``: nothing or a causal-side ramp (NoPE, ALiBi) — the largest tiles;
* ``table``: a gathered table entry, and in dQ the derivative tables (one vector load per
  four entries) with one [BLOCK_M, BLOCK_N] accumulator per learnable parameter (GGD, BAM,
  Cauchy, KERPLE). On sm_90 both backward kernels keep the warpgroup MMA: 64 rows in dQ, 64
  keys in dK/dV (below that the warps re-read their operands through shared memory);
* ``dist``: a table prior whose dQ kernel sums dS per distance (T5's 32 buckets);
* ``heavy``: many scalars, read from memory per score (FIRE's MLP);
* ``general``: a printed expression per score, or a score other than s + log_prior (SSMax).

Every entry compiles with no register spills and within the family's shared memory for every
shipped prior of that kind, for bf16 and head dims 64 and 128 (tests/gpu/test_aot.py checks the
defaults and the alternates; ``python benchmarks/tile_sweep.py`` is the sweep that chose them,
and docs/performance.md has its figures). Among the spill-free tiles the default is the one the
model ranks best with num_stages >= 2 (software pipelining hides load latency, which the
five throughput units do not see), one stage where no two-stage tile is spill-free (the light
kind's dK/dV at head dim 128 on sm_80) or where the latency term, which sees the pipeline, puts
one stage below two as well (the light and table kinds' dK/dV at head dim 64 on sm_90). Head
dim 256 is outside that guarantee.
"""
from __future__ import annotations

_HEAD_256 = {"fwd": [(32, 32, 4, 2)], "bwd_dkdv": [(16, 32, 4, 1)], "bwd_dq": [(32, 16, 4, 1)]}

TILES = {
    "light": {
        # forward on sm_90: three stages, which the model cannot rank (equal cycles) and an H200
        # timed at 0.89x (head dim 64) and 0.88x (128) of two for NoPE (kernel times;
        # docs/performance.md, "Third GPU session"); two stages stay the alternate
        "sm_90": {
            # dK/dV: one stage, with its steady tiles (DKDV_STEADY_AT), where both models put
            # it below two: NoPE 127 against 143 five-unit cycles / 1k scores, latency term 178
            # against 203 (unsplit, two stages: 171, 207; docs/performance.md, "The dK/dV
            # kernel's steady tiles"). An H200 timed it at 0.81x the unsplit two-stage kernel
            # (NoPE, N = 8192: 1473 against 1813 us; GGD 0.83x). Three stages, which the latency
            # term preferred: NoPE 0.95-1.02x one from 2k to 16k tokens, GGD 1.08-1.13x
            # ("Fifth GPU session")
            64: {"fwd": [(128, 64, 8, 3), (128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 1), (32, 64, 4, 2)],
                 "bwd_dq": [(64, 32, 4, 2)]},
            # dK/dV: 32 keys are too few for the warpgroup MMA, so 64x32 re-reads its operands
            # through shared memory (modelled LSU-bound at 691 cycles / 1k scores, 32x64: 318)
            128: {"fwd": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2), (64, 32, 4, 2)],
                  "bwd_dq": [(64, 32, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2)], "bwd_dq": [(64, 32, 4, 2)]},
            # dK/dV: 64x32 spills 16-24 bytes since the per-row key counts and NaN containment;
            # 32x64 is the best-modelled spill-free tile (docs/performance.md, "Tile sizes") in
            # one stage: with two (LSU-modelled 820 against 934 cycles / 1k scores) NoPE's and
            # FoX's put 8-32 bytes on the stack at 255 registers since dK/dV reads its rows'
            # statistics from the preprocess kernel
            128: {"fwd": [(64, 64, 4, 2), (128, 32, 8, 1)], "bwd_dkdv": [(32, 64, 4, 1)],
                  "bwd_dq": [(64, 32, 4, 2)]},
            256: _HEAD_256,
        },
    },
    "table": {
        # forward on sm_90: three stages (GGD, kernel times: the H200 at head dim 128, 0.90x of
        # two; the H100 at 64 with the table read directly, FWD_TABLE_GATHER_AT, 0.87x)
        "sm_90": {
            # dK/dV at 64: one stage with its steady tiles, as the light kind's (GGD 160 and 258
            # against 193 and 382)
            64: {"fwd": [(128, 64, 8, 3), (128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 1), (32, 64, 4, 2)],
                 "bwd_dq": [(64, 32, 4, 2), (64, 16, 4, 2)]},
            128: {"fwd": [(128, 64, 8, 3), (128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2)], "bwd_dq": [(64, 32, 4, 2), (64, 16, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(64, 32, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            128: {"fwd": [(128, 32, 8, 2)], "bwd_dkdv": [(32, 32, 8, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            256: _HEAD_256,
        },
    },
    # a table prior whose dQ kernel sums dS per distance (DIST_SUMS: T5's buckets): the skewed
    # [BLOCK_M, 2 * max(BLOCK_M, BLOCK_N)] tile and the derivative tables' slab take registers,
    # so dQ keeps 32 rows (sm_90 included: 64 rows spill 216-1272 bytes with 4 or 8 warps)
    "dist": {
        "sm_90": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            128: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(64, 32, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            128: {"fwd": [(128, 32, 8, 2)], "bwd_dkdv": [(32, 32, 8, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            256: _HEAD_256,
        },
    },
    # a prior of many scalars read from memory per score (FIRE's MLP: 99 weights, about 100
    # FP32 operations per score): small tiles, since the per-score work, not the MMA, bounds
    # them; dQ sums 8 learnable scalars a launch (4 with masks: GRAD_GROUPS) at 16 x 16
    "heavy": {
        "sm_90": {
            64: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(32, 32, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            # dK/dV at head dim 128: 32x32 spills 16 bytes (32x16: 0, modelled 2289 cycles / 1k)
            128: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(32, 16, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(32, 32, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            # forward at head dim 128: 64x32 spills 112 bytes (32x64: 0, modelled 2758 / 1k);
            # dK/dV: 32x32 spills 8 bytes since dS is selected on P (32x16: 0, both modelled
            # 2734 / 1k, FP32-bound)
            128: {"fwd": [(32, 64, 4, 2)], "bwd_dkdv": [(32, 16, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            256: _HEAD_256,
        },
    },
    "general": {
        "sm_90": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2)], "bwd_dq": [(64, 32, 4, 2), (64, 16, 4, 2)]},
            128: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2), (32, 32, 8, 2)], "bwd_dq": [(64, 32, 4, 2), (64, 16, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(64, 32, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            128: {"fwd": [(128, 32, 8, 2)], "bwd_dkdv": [(32, 32, 8, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            256: _HEAD_256,
        },
    },
    # The positional plan (position tensors, docs/positions.md): each tile loads its rows' and
    # keys' positions, and the backward kernels accumulate the positions' gradient terms score
    # by score beside dS. positions_light: a bias of a few operations and no learnable parameter
    # (FoX's d); positions: the rest (ALiBi's |d|/b, GGD's power, SSMax, Sandwich's cosines). Chosen by the sweep in
    # docs/performance.md ("Positions as tensors"): spill-free for the shipped priors of the
    # kind, bf16, head dims 64 and 128, the best modelled.
    "positions_light": {
        "sm_90": {
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(32, 64, 4, 2)], "bwd_dq": [(64, 32, 4, 2)]},
            128: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(16, 64, 4, 2)], "bwd_dq": [(64, 32, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            # dK/dV: 32x64 spills 8 bytes at head dim 64, 16x64 32 at 128 (the gradient terms'
            # [BLOCK_N, BLOCK_M] tile); sm_80's 128 is the register-bound case: LSU-bound, 2x NoPE
            64: {"fwd": [(128, 64, 8, 2)], "bwd_dkdv": [(16, 64, 4, 2)], "bwd_dq": [(64, 32, 4, 2)]},
            128: {"fwd": [(64, 64, 4, 2)], "bwd_dkdv": [(16, 32, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            256: _HEAD_256,
        },
    },
    "positions": {
        "sm_90": {
            64: {"fwd": [(64, 64, 4, 2)], "bwd_dkdv": [(16, 64, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            128: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(16, 64, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            # forward at head dim 64: 64x64 puts 8 bytes on the stack (168 registers a thread)
            64: {"fwd": [(128, 32, 8, 2)], "bwd_dkdv": [(32, 32, 4, 2)], "bwd_dq": [(32, 32, 4, 2)]},
            128: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(16, 32, 4, 2)], "bwd_dq": [(16, 32, 4, 2)]},
            256: _HEAD_256,
        },
    },
    # T5's buckets over position tensors: the heavy kind's backward tiles; its forward tile
    # 64x32 over 4 warps put 8-200 bytes on the stack (sm_90 at head dim 128, sm_80 at both),
    # so 8 warps there on sm_90 and 32x32 on sm_80. Swept with `python benchmarks/tile_sweep.py
    # --layout positions --kernel fwd --priors t5 t5_bidirectional`.
    "positions_vectors": {
        "sm_90": {
            64: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(32, 32, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            128: {"fwd": [(64, 32, 8, 2)], "bwd_dkdv": [(32, 16, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(32, 32, 4, 2)], "bwd_dkdv": [(32, 32, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            128: {"fwd": [(32, 32, 4, 2)], "bwd_dkdv": [(32, 32, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            256: _HEAD_256,
        },
    },
    # FIRE over position tensors: the heavy kind, whose dK/dV kernel also runs the MLP's
    # backward per score for the positions' gradient. Its 32-key tiles spill (sm_90, head dim
    # 64: 3,904 bytes of stack at 32x32, 80 at 32x16); 16x16 is spill-free with 8 warps (4
    # put 128 bytes on the stack on sm_90 at head dim 128, 40 on sm_80, and 72 with packed
    # documents on sm_90 at 64); its dQ (the parameters' sums, 4 scalars a launch, beside the
    # positions') at 16x16 takes 8 warps but on sm_80 at 64 (4 warps: 40-56 bytes). With packed
    # documents on sm_90 at 128 the forward put 24 bytes on the stack at 64x32 (so 32x32) and
    # the dQ kernel 32 with two stages (so one). Swept with
    # `python benchmarks/tile_sweep.py --layout positions --kernel bwd_dkdv --priors fire`
    # (and the other kernels, and --layout positions_packed).
    "positions_heavy": {
        "sm_90": {
            64: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(16, 16, 8, 2)], "bwd_dq": [(16, 16, 8, 2)]},
            128: {"fwd": [(32, 32, 4, 2)], "bwd_dkdv": [(16, 16, 8, 2)], "bwd_dq": [(16, 16, 8, 1)]},
            256: _HEAD_256,
        },
        "sm_80": {
            64: {"fwd": [(64, 32, 4, 2)], "bwd_dkdv": [(16, 16, 4, 2)], "bwd_dq": [(16, 16, 4, 2)]},
            128: {"fwd": [(32, 64, 4, 2)], "bwd_dkdv": [(16, 16, 8, 2)], "bwd_dq": [(16, 16, 8, 2)]},
            256: _HEAD_256,
        },
    },
}

# The decode kernel (a generation step: 1-16 query rows, the keys split over programs). Its
# tile is one MMA's 16 rows by the longest key tile the registers allow: shared-memory traffic
# bounds its main loop, and a longer key tile issues fewer instructions per key (sm_90, head
# dim 128: 16x128 models 9.9k LSU cycles per 1000 keys, 16x64 11.1k, 16x32 13.9k; 16x256
# spills at head dim 64; three stages there cap a table prior's registers and spill 8 bytes).
# What the prior computes per score matters little at 16 rows, so every kind shares it.
_DECODE = {64: [(16, 128, 4, 2)], 128: [(16, 128, 4, 2)], 256: [(16, 64, 4, 2)]}
for _families in TILES.values():
    for _by_dim in _families.values():
        for _dim, _kernels in _by_dim.items():
            _by_dim[_dim] = {**_kernels, "decode": _DECODE[_dim]}

def _derived(kind: str, changes: dict) -> dict:
    """A copy of TILES[kind] with {(arch, head dim, kernel): candidates} replaced."""
    table = {arch: {dim: dict(kernels) for dim, kernels in dims.items()}
             for arch, dims in TILES[kind].items()}
    for (arch, dim, kernel), configs in changes.items():
        table[arch][dim][kernel] = configs
    return table


# A table prior at integer position tensors (TABLE_POSITIONS, traits.position_table_traits): the
# token table kernels' tiles, but dQ on sm_90 takes its first candidate alone, and at head dim
# 128 64x16, where 64x32 put 24 bytes on the stack for KERPLE and Gaussian (the entries'
# addresses are per score now, not a row's base plus the key's index); 64x16 takes 164-207
# registers and none. Swept with `python benchmarks/tile_sweep.py --layout positions_table
# --kernel bwd_dq --head-dim 128`.
TILES["positions_table"] = _derived("table", {("sm_90", 64, "bwd_dq"): [(64, 32, 4, 2)],
                                              ("sm_90", 128, "bwd_dq"): [(64, 16, 4, 2)]})

# How the forward reads a table prior's tile of entries (the TABLE_GATHER constexpr of _attn_fwd):
#   "async"     tl.load, which Triton's software pipeliner turns into asynchronous copies into
#               shared memory (one 4-byte LDGSTS per score: the rows of a tile start one entry
#               apart, so no wider copy is aligned), read back in the MMA layout: a
#               [BLOCK_M, BLOCK_N] float32 buffer of shared memory (32 KB at 128x64). Where
#               BLOCK_N equals the head dim (128x64 at 64), the pointers have the shape of Q's
#               load and O's store, and Triton's coalescing pass gives every access of one shape
#               the widest vector among them: Q's 8 bf16, so each thread copies 8 entries of a row
#               32 bytes apart from its neighbour's, and a warp's 4-byte copy touches 32 sectors
#               for 128 bytes (Triton 3.6 and 3.9; at head dim 128 the copy is coalesced);
#   "coalesced" the same copy from pointers shaped [BLOCK_M, 1, BLOCK_N], a shape of their own: a
#               warp copies 32 consecutive entries of a row (4-5 sectors); read back with 32
#               4-byte shared loads instead of 16 8-byte ones (the same wavefronts), and 215-218
#               registers instead of 168-174 at head dim 64 on sm_90 (one CTA per SM either way);
#   "direct"    ld.global.nc in the MMA layout (helpers._table_load, as the backward kernels
#               gather): no shared memory and no copy back, but the load is not pipelined.
#   "prefetch"  "direct" one key tile ahead: each tile's entries are read in registers at the
#               previous tile's top (forward._attn_fwd_inner), so a load has a tile's work to
#               arrive under; read in the tile that uses them, ptxas issues them after the
#               score MMA's wait and waits for each in turn (BAM-SSMax's forward at 128: 16 L2
#               round trips a tile in series). The same entries, the same bits; 198-243
#               registers against 182-224 (one CTA per SM either way). Positions from tensors
#               read directly (the keys' positions come with their tile).
# The H200 measured the "async" table forwards at 1.40x NoPE's at head dim 128 and 3.4-3.9x at
# 64 (docs/performance.md, "Where a table forward's time goes"). Which read is faster is for a
# GPU to decide: `make gpu-check` times the reads against the shipped one (gpu_check.VARIANT_PEERS:
# now the async read, the one no longer shipped on sm_90). Its run
# of 2026-11-26 (an H200, Triton 3.6, GGD, N = 8192, forward kernels; docs/performance.md,
# "Third GPU session"; kernel times): at head dim 64 "direct" took 0.57x the "async" read's
# time and "coalesced" 2.6x; at 128 "direct" 1.01x and "coalesced" 3.6x. So sm_90 read directly at 64
# from then on, and the decode kernel keeps "async" ("coalesced" was 1.06-1.10x there).
# An H100 (2026-11-27, "Fourth GPU session") agreed: at 64 "direct" 0.57x "async" (368 against
# 650 cycles per 1000 scores), at 128 0.95x; the decode kernel's "coalesced" 1.09-1.14x. So
# sm_90 reads directly at 128 too (1.01x and 0.95x: no worse on either GPU), which also takes
# BAM-SSMax's forward off the path its 4x-slow kernel took: at 255 registers its async read
# came back from shared memory one 8-byte load at a time, each waited for (direct: 207
# registers, no shared-memory round trip); that kernel is timed against the async read next.
# Then (2026-11-27, no GPU; docs/performance.md, "Latency and occupancy, tested") the SASS's
# scoreboards showed the direct read waiting for its loads one at a time, and the latency term
# (which cuts the model's median error from 10% to 6%) put one warp's pass of SSMax's forward
# at 128 at 6,293 cycles with the direct read and 2,086 read ahead (GGD 1,961 and 1,714; at 64
# GGD 1,541 and 1,330, SSMax 1,942 and 1,376), spill-free for all ten table priors in the
# plain, key-mask and packed layouts (integer positions read directly) with Triton 3.6 and
# 3.9. So sm_90 reads ahead at both head dims, and `make gpu-check`'s variants step times the
# direct read against it.
FWD_TABLE_GATHER = "async"
FWD_TABLE_GATHER_AT = {("sm_90", 64): "prefetch", ("sm_90", 128): "prefetch"}
TABLE_GATHERS = ("async", "coalesced", "direct", "prefetch")


# Where the forward can read its keys and values through the Tensor Memory Accelerator, and its
# tile there (shipped nowhere since an H200 timed it: KV_TMA_SHIPPED below). KV_TMA of
# _attn_fwd: host tensor descriptors over K and V as [B * Hk, Nk, D], one UTMALDG a tile from
# one thread, zeros past Nk and D, where pointers give every thread a 64-bit address and a
# bounds compare a vector. The copy itself models no faster: the loop
# issues what it did, 8 warps 78 against 76 (NoPE, head dim 64, sm_90, five units per 1000
# scores). What it frees is registers: NoPE's 128x64 tile over 4 warps takes 207 a thread where
# pointers take 255, and 4 warps issue the row statistics and loop control once per 128 rows
# where 8 do it twice: 66 against 76, Triton's fused-attention tutorial's 66 (it reads through
# TMA with this tile; the H200 timed it 1.11x faster than bamgen's 8-warp NoPE), with 3 stages:
# Triton issues a tile's copies at the loop's bottom, so with 2 each pass waits out a copy
# (latency term 115 against 92 with 3; the tutorial's 112 and 89). The latency term still
# disagrees (92 against 62), so the 8-warp pointer tile stays the alternate and `make
# gpu-check`'s variants step times it (gpu_check.VARIANT_PEERS). ALiBi (the light kind too): 86
# against 104 (latency 99 against 129); FoX's kernels are positional (a tile kind of their own)
# and keep pointers. The table and general kinds keep pointers:
# with TMA their 8-warp tiles model no better (GGD 113 against 105 at 64) and their 4-warp ones
# spill. Eager launches on sm_90 without a key mask, per-row offsets or packed documents, with
# 16-bit inputs whose rows are 16-byte aligned (launch.kv_tma); the masked layouts keep pointers
# (a padding key's v must read as 0; a document's last tile runs into the next), and so do
# traced launches (torch.compile), which no GPU has run with descriptors yet. docs/performance.md,
# "Keys and values through TMA".
FWD_TMA_AT = {("light", "sm_90", 64): (128, 64, 4, 3)}


# Where the decode kernel can read K and V through TMA (shipped nowhere since an H200 timed it:
# KV_TMA_SHIPPED below), for every kind (its tile, 16 rows by 128 keys, is the same for all). Its loop is bound by the load/store unit: the cp.async copies of
# 128 keys' K and V and the MMA operands read back from shared memory. Through descriptors the
# copies leave the loop: NoPE at head dim 64 on sm_90 models 324 -> 191 cycles per 1000 keys
# and rows (latency term 236 -> 151), at 128 559 -> 301 (411 -> 267); GGD 387 -> 268 (372 ->
# 255) and 621 -> 377 (428 -> 415); both models agree. Every kind but heavy (FIRE's decode
# through descriptors took 168 registers and 16 bytes of stack at head dim 128; its loop is
# bound by its MLP's FP32 work, not the copies). The same layouts as the forward's
# (launch.kv_tma): a key mask, per-row offsets and traced launches keep pointers.
# docs/performance.md, "Keys and values through TMA".
DECODE_TMA_AT = frozenset((kind, "sm_90", dim) for kind in ("light", "table", "dist", "general")
                          for dim in (64, 128))


def fwd_tma_tile(kind: str, arch: str | None, head_dim: int):
    """The forward's tile where it reads K and V through TMA (FWD_TMA_AT), else None."""
    return FWD_TMA_AT.get((kind, arch, head_dim_bucket(head_dim)))


# Which kernels read K and V through TMA unless pinned (pinned(kv=...)): none, since an H200
# timed both reads against pointers (Triton 3.6, 2026-11-27; docs/performance.md, "Fifth GPU
# session"). NoPE's forward at head dim 64 through TMA, FWD_TMA_AT's 4-warp tile, took 761 us
# of kernel time where the 8-warp pointer kernel took 709 (1.07x; 1.04-1.09x at 2k-16k tokens),
# and 1.17x its time a call: the latency term had ranked them so (92 against 62), the five
# units the other way. The decode call (GGD, 64 sequences against 4096 keys) took 1.03x and
# 1.07x the pointer one at head dims 64 and 128, where both models had said 0.6-0.7x. The
# tables above stay: what a pinned kv="tma" launch takes, and what a GPU times against pointers
# (gpu_check.VARIANT_PEERS).
KV_TMA_SHIPPED: frozenset = frozenset()


def reads_kv_through_tma(kernel: str, kind: str, arch: str | None, head_dim: int) -> bool:
    """Whether a kernel ("fwd" or "decode") of a tile kind reads K and V through TMA on a GPU
    family at a (padded) head dim unless pinned, where the layout allows: a kernel that
    KV_TMA_SHIPPED names, where FWD_TMA_AT or DECODE_TMA_AT names the kind, family and head
    dim."""
    if kernel not in KV_TMA_SHIPPED:
        return False
    if kernel == "decode":
        return (kind, arch, head_dim_bucket(head_dim)) in DECODE_TMA_AT
    return fwd_tma_tile(kind, arch, head_dim) is not None


HEAD_DIM_BUCKETS = (64, 128, 256)   # the head dims of the tables above: a smaller one takes the next


def head_dim_bucket(head_dim: int) -> int:
    """The tile tables' head dim for a (padded) head dim: a head dim of 32 runs the 64 tiles."""
    return min(b for b in HEAD_DIM_BUCKETS if b >= head_dim)


# Where the dQ kernel splits off its steady run (SPLIT_STEADY of backward._attn_bwd_dq): the key
# tiles that every row of a whole query tile sees whole go through a loop with no causal or
# bounds mask, as the forward's do. NoPE's dQ loop at head dim 64 on sm_90 issues 216
# instructions a pass instead of 310 (151 -> 105 issue cycles per 1000 scores, against a tensor
# floor of 94), GGD's 236 -> 209 (Triton 3.9). But the split raises registers (BAM's, Cauchy's,
# the Gaussian's and KERPLE's at 64 on sm_90 from 213 to 242), and it spills where the loop was
# near 255 already: the table kind's 64x32 at head dim 128 on sm_90 (64 bytes; its 64x16 split models 289 against 64x32's
# 242 unsplit), T5's (8-24 bytes; an LSU-bound loop it does not shorten), FIRE's (240-328),
# BAM-SSMax's packed on sm_80 at 128 (16), Laplace's at 128 on sm_80 with Triton 3.6 (8; the
# light kind's dQ there is LSU-bound in the model either way). So it is on for the (tile kind,
# family, head dim bucket) below, each spill-free with Triton 3.9 and 3.6 in the plain, key-mask
# and packed layouts for every candidate (tests/gpu/test_aot.py and test_aot_masks.py compile
# the plain, key-mask and packed kernels of the shipped priors at 3.9's defaults), and off for
# the kernels of positions as tensors (bound by the positions' work) and wherever not named.
# docs/performance.md, "The dQ kernel's steady run".
DQ_STEADY_AT = frozenset({("light", "sm_80", 64), ("light", "sm_90", 64), ("light", "sm_90", 128),
                          ("table", "sm_90", 64), ("general", "sm_90", 64)})


# The dK/dV kernel's steady tiles (SPLIT_STEADY of backward._attn_bwd_dkdv): the query tiles
# whose rows all exist and see every key of the program's key tile (between the diagonal's and
# the ragged end's) skip the mask's where() through a uniform branch in the one loop. Its first
# form, three loops (the diagonal, the steady run, the ragged end), took 255 registers for
# NoPE's 149 at head dim 64 on sm_90 (two CTAs an SM for three), and the two models disagreed
# (five units 141 against 179, latency term 304 against 210). With the branch, 160 registers,
# and the model takes the pass that skips the mask (bamgen.aot.shortest_pass). On for the light
# and table kinds at head dim 64 on sm_90, with one stage (TILES), where both models put every
# prior of the two kinds below the unsplit two-stage kernel (five units; latency term): NoPE 127
# and 178 against 171 and 207, ALiBi 245 and 221 against 273 and 390 (its dS is selected on the
# mask, which it computes anyway: its gain is the one stage), FoX 212 and 222 against 244 and
# 230, every table prior 160 and 258 against 193 and 382 (the key-mask and packed layouts'
# 16x64: 188 and 242 against 247 and 758, 230 and 667 against 259 and 1009); spill-free in the
# plain, key-mask and packed layouts with Triton 3.9. Not BAM-SSMax's (general: latency term
# 934 against 433); at head dim 128 NoPE's is tensor-bound (250) either way; sm_80 not tried
# yet. benchmarks/gpu.py's bamgen-<prior>@dkdv_split=off,bwd_dkdv=32x64x4x2 peers time the
# kernel it replaced (docs/performance.md, "The dK/dV kernel's steady tiles").
DKDV_STEADY_AT = frozenset({("light", "sm_90", 64), ("table", "sm_90", 64)})


STEADY_AT = {"bwd_dq": DQ_STEADY_AT, "bwd_dkdv": DKDV_STEADY_AT}


def splits_steady(kernel: str, kind: str, arch: str | None, head_dim: int) -> bool:
    """Whether a backward kernel ("bwd_dq", "bwd_dkdv") of a tile kind splits off its steady
    run on a GPU family at a (padded) head dim (STEADY_AT, by the head dim's bucket). arch None:
    the interpreter's small tiles, which split wherever some family does (so the tests run both
    loops of the kinds that split, and one loop, as every GPU does, for those that never do: T5,
    FIRE, the kernels of positions as tensors)."""
    if arch is None:
        return any(kind == split_kind for split_kind, _, _ in STEADY_AT[kernel])
    return (kind, arch, head_dim_bucket(head_dim)) in STEADY_AT[kernel]


def fwd_table_gather(arch: str, head_dim: int) -> str:
    """The forward's table read on a GPU family at a (padded) head dim, by its bucket (the
    read was timed with the bucket's tile)."""
    return FWD_TABLE_GATHER_AT.get((arch, head_dim_bucket(head_dim)), FWD_TABLE_GATHER)

# Learnable scalars one dQ launch sums, per kind (8 where not named): a launch per group
# (launch.grad_groups), each with the registers of that many accumulators, and each
# recomputing the logits. FIRE (heavy: 99 scalars) takes 8 a launch, 13 launches, where 4 took
# 25: the H200 measured its dQ at 25 launches of 80 ms (docs/performance.md, "Third GPU
# session"), and the model prices a launch of 8 at 1.1x one of 4 (sm_90, head dim 128: 8570
# against 7777 cycles per 1000 scores; 0.57x the whole dQ), its first launch spill-free on
# sm_80 and sm_90 at head dims 64 and 128 with Triton 3.6 and 3.9. With a key mask, per-row offsets or packed
# documents (GRAD_GROUPS_MASKED, 8 warps a launch) 8 put 24-32 bytes on the stack on sm_90 at
# head dim 128, so those keep 4. The launches after the first read each row's sum of dS from
# it (DS_ROWS_KNOWN) and keep one accumulator a scalar; on sm_90 some still keep 8 bytes of
# stack, where 6 a launch keeps none at 17 launches (docs/performance.md, "FIRE's later groups").
GRAD_GROUPS = {"heavy": 8, "positions_vectors": 4, "positions_heavy": 4}
GRAD_GROUPS_MASKED = {"heavy": 4}

# Small tiles under TRITON_INTERPRET=1, so that tests cross many tile borders quickly (unless
# BAMGEN_INTERPRET_TILES names a GPU family, whose tiles the interpreter then takes).
INTERPRET_TILES = {
    "fwd": (32, 16, 4, 1),
    "bwd_dkdv": (16, 32, 4, 1),
    "bwd_dq": (32, 16, 4, 1),
    "decode": (16, 16, 4, 1),
}
