"""Device functions the kernels share: arithmetic helpers, loads, the layout's bounds, and the
logit of a tile of scores as every kernel computes it (the _logit2 family), where the prior's
hooks enter (hooks.py).

Module constexprs (False under TRITON_INTERPRET=1, which cannot run inline PTX and calls a
custom tl.reduce combine element by element in Python):
  _TABLE_PTX    (_table_load, _table_load4) gather table entries with ld.global.nc
  _ROW_DOT_FMA  (_row_dot) row sums of products through a one-FFMA tl.reduce combine
Launch constexprs the helpers take: DOT_PREC (tl.dot's input precision: "ieee" for float32
inputs, "tf32" (unused) otherwise); UPCAST_DOT (tl.dot on float32 copies of its operands: only
under TRITON_INTERPRET=1 with bf16 inputs, whose dot the Triton 3.9 interpreter gets wrong, as it
multiplies the raw uint16 storage; bf16 values are exact in float32, so rounding is kept);
MASK_KEYS (_load_kv: mask keys past Nk; D < HEAD_DIM masks the padded head dim); ROW_OFFSETS
(_row_offsets: per-row q_offset / k_offset tensors instead of the scalars); VARLEN
(_program_span: a program's rows and keys are one packed document's); ROWS, BLOCK_N
(_window_keys: the tile's query rows and keys).
"""
import triton
import triton.language as tl

from . import interpreting
from .hooks import (  # noqa: F401 (each prior's kernels get its own: variant.py)
    CLAMP_POSITIONS, HAS_BIAS, LOGIT_FMA, POSITIONS, ROW_FACTORS, SCORE_IS_S, TABLE, TABLE_SLOTS,
    prior_bias, prior_grads, prior_logit_row, prior_logit_score, prior_position_grads,
    prior_row_factors)

# Gather table entries through PTX (see _table_load) when compiling for a GPU; the interpreter
# cannot run inline assembly and takes tl.load.
_TABLE_PTX = tl.constexpr(not interpreting())
# Row sums of products through one FFMA per element (see _row_dot) when compiling for a GPU;
# the interpreter runs a custom tl.reduce combine element by element and takes tl.sum.
_ROW_DOT_FMA = tl.constexpr(not interpreting())
# Round float32 to bfloat16 to nearest even by hand (see _lowp) under the interpreter, whose
# cast truncates where a GPU's rounds.
_BF16_RN_BY_HAND = tl.constexpr(interpreting())

# Never let a launcher specialise d_top. A query's table row starts at d_top - i, which falls as
# i rises; some Triton releases (3.6 among them) call `x - arange` contiguous (AxisInfo of
# SubIOp), so when d_top is known to be a multiple of 16 (or a constant) they emit vector loads
# over rows that run backwards: a misaligned-address fault, or wrong entries, on the GPU (never
# in the interpreter). The kernels take d_top_b = d_top + TABLE_ROW_BIAS and compute
# d_top_b - 33554433 (the bias, written out in the kernels): an odd constant, so the difference
# has no divisibility the compiler can know whatever it was told of d_top_b, and larger than any
# |d_top| (positions stay within 2**24), so d_top_b is never 1, a value launchers turn into a
# constant. Triton's own launcher is told nothing (do_not_specialize); inductor, which launches
# the kernels under torch.compile (the triton ops) and ignores do_not_specialize, may mark
# d_top_b divisible by 16 without harm. Every such load stays a scalar one.
TABLE_ROW_BIAS = 2 ** 25 + 1
TABLE_ROW_ARGS = ["d_top_b"]


@triton.jit
def _fp32_scalars(sm_scale, row_abs):
    """The kernels' float arguments as float32. Inductor types a Python float fp64 when it
    launches a kernel (torch.compile, the triton ops), where an eager launch passes fp32: an
    fp64 sm_scale would carry fp64 into the logits and the accumulator, which tl.dot refuses
    (docs/architecture.md, "Custom ops")."""
    return tl.cast(sm_scale, tl.float32), tl.cast(row_abs, tl.float32)


@triton.jit
def _atan(x):
    """atan in fp32 (Cephes atanf, about 2 ulp): Triton has no intrinsic, and libdevice's
    is not available under the interpreter the tests run. Range reduction to |t| < tan(pi/8)
    through atan(a) = pi/2 + atan(-1/a) and atan(a) = pi/4 + atan((a - 1)/(a + 1))."""
    a = tl.abs(x)
    big = a > 2.414213562373095      # tan(3 pi / 8)
    mid = a > 0.4142135623730950     # tan(pi / 8)
    t = tl.where(big, -1.0 / a, tl.where(mid, (a - 1.0) / (a + 1.0), a))
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = t * t
    r = base + (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z
                - 3.33329491539e-1) * z * t + t
    return tl.where(x < 0, -r, r)

@triton.jit
def _position(x_abs):
    """An absolute position as the hooks see it, float32: a padding token's negative position
    reads as 0 where the prior reads i or j (CLAMP_POSITIONS)."""
    if CLAMP_POSITIONS:
        x_abs = tl.maximum(x_abs, 0)
    return x_abs.to(tl.float32)


@triton.jit
def _distance(i_abs, j_abs):
    """d = i - j as the hooks see it, float32: from the positions _position gives."""
    if CLAMP_POSITIONS:
        i_abs = tl.maximum(i_abs, 0)
        j_abs = tl.maximum(j_abs, 0)
    return (i_abs - j_abs).to(tl.float32)


# ----------------------------------------------------------------------------------------
# Positions as tensors (POSITIONS = C > 0): [B, Hq, N, C] float32, contiguous. One channel is a
# tile; several are a tuple of tiles, channel by channel (the hooks read pos_d[c]).
@triton.jit
def _tensor_positions(Pos, head_row0, offs, ok):
    """The positions of tokens offs of one head ([len(offs)] per channel); head_row0: the
    index of the head's first token, (b * Hq + h) * N (int64)."""
    at = Pos + (head_row0 + offs) * POSITIONS
    if POSITIONS == 1:
        out = tl.load(at, mask=ok, other=0.0)
    else:
        out = ()
        for c in tl.static_range(POSITIONS):
            out = out + (tl.load(at + c, mask=ok, other=0.0),)
    return out


@triton.jit
def _as_rows(p):
    """[M] positions (per channel) as a column [M, 1]: one per query row."""
    if POSITIONS == 1:
        out = p[:, None]
    else:
        out = ()
        for c in tl.static_range(POSITIONS):
            out = out + (p[c][:, None],)
    return out


@triton.jit
def _as_cols(p):
    """[N] positions (per channel) as a row [1, N]: one per key."""
    if POSITIONS == 1:
        out = p[None, :]
    else:
        out = ()
        for c in tl.static_range(POSITIONS):
            out = out + (p[c][None, :],)
    return out


@triton.jit
def _position_diff(pos_i, pos_j):
    """d = i - j, channel by channel."""
    if POSITIONS == 1:
        out = pos_i - pos_j
    else:
        out = ()
        for c in tl.static_range(POSITIONS):
            out = out + (pos_i[c] - pos_j[c],)
    return out


@triton.jit
def _own_distance(pos_i):
    """d = 0 at each row's own position, shaped as pos_i: one [M, 1] per channel (a tuple
    over more than one), so that the dQ kernel can read the derivatives there (CENTER_GRADS)."""
    if POSITIONS > 1:
        out = ()
        for c in tl.static_range(POSITIONS):
            out = out + (pos_i[c] * 0.0,)
    else:
        out = pos_i * 0.0
    return out


@triton.jit
def _position_terms(accs, ds, p, grads, FIRST: tl.constexpr):
    """accs[c] + dS * grads[FIRST + c] for each channel c, score by score (0 where P is: a
    derivative may be infinite on a hidden score, and 0 * inf is NaN). The tiles are summed
    once, after the loop (_position_reduce): a row reduction per key tile goes through shared
    memory and made the dQ loop LSU-bound."""
    out = ()
    for c in tl.static_range(POSITIONS):
        g = tl.where(p > 0.0, grads[FIRST + c], 0.0)
        out = out + (tl.fma(ds, g, accs[c]),)
    return out


@triton.jit
def _position_reduce(accs, AXIS: tl.constexpr):
    """Each channel's accumulated tile summed along AXIS."""
    out = ()
    for c in tl.static_range(POSITIONS):
        out = out + (tl.sum(accs[c], AXIS),)
    return out


@triton.jit
def _zero_tiles(ROWS: tl.constexpr, COLS: tl.constexpr):
    """One [ROWS, COLS] float32 accumulator per channel."""
    out = ()
    for c in tl.static_range(POSITIONS):
        out = out + (tl.zeros([ROWS, COLS], dtype=tl.float32),)
    return out


@triton.jit
def _store_positions(Pos, head_row0, offs, ok, sums):
    """Write one [len(offs)] sum per channel at the tokens offs of one head."""
    at = Pos + (head_row0 + offs) * POSITIONS
    for c in tl.static_range(POSITIONS):
        tl.store(at + c, sums[c], mask=ok)


@triton.jit
def _element(index, elements):
    """w[index] for a vector's elements (a tuple of scalars), as the runtime's element_at: a
    chain of selects, w[0] below 1 (and for NaN), w[k] from k on (the clamp)."""
    out = elements[0] + tl.zeros_like(index).to(tl.float32)
    for k in tl.static_range(1, len(elements)):
        out = tl.where(index >= k, elements[k], out)
    return out


@triton.jit
def _index_floor(x):
    """floor of an index in float64, a value within 1e-12 (relative) of an integer snapped to
    it: the runtime's index_floor (bamgen.runtime.params)."""
    nearest = tl.floor(x + 0.5)
    near = tl.abs(x - nearest) <= 1e-12 * tl.maximum(tl.abs(x), 1.0)
    return tl.where(near, nearest, tl.floor(x))


@triton.jit
def _index_ceil(x):
    """ceiling of an index, as _index_floor."""
    nearest = tl.floor(x + 0.5)
    near = tl.abs(x - nearest) <= 1e-12 * tl.maximum(tl.abs(x), 1.0)
    return tl.where(near, nearest, tl.ceil(x))


@triton.jit
def _load_vector(ptr, SIZE: tl.constexpr):
    """A vector parameter's SIZE elements from ptr on, as a tuple of scalars (prior_scalars)."""
    out = ()
    for k in tl.static_range(SIZE):
        out = out + (tl.load(ptr + k),)
    return out


@triton.jit
def _load_vector64(ptr, SIZE: tl.constexpr):
    """A vector parameter's SIZE elements from ptr on, in float64 (the distance-table hook)."""
    out = ()
    for k in tl.static_range(SIZE):
        out = out + (tl.load(ptr + k).to(tl.float64),)
    return out


@triton.jit
def _pow64(base, exp):
    """base ** exp in float64 as torch.pow computes it on the host, through exp(exp * log|base|)
    (libdevice's pow is not available under the interpreter the tests run): x ** 0 = 1 and
    1 ** y = 1, NaN included; a negative base takes an integer power with its sign, and gives
    NaN for any other. The relative error, about |exp * log(base)| * 2**-53, is far below the
    float32 rounding the table then takes, except at a tie, which a float32 parameter times an
    integer distance often is: so the exponents 1, 2 and -1 (GGD's and KERPLE's usual initial
    values) are taken exactly, as pow does. -0.0 takes +0.0's powers but for its odd integer
    ones, which are signed (-0.0 ** -1 = -inf): a product such as a * d with a < 0 gives it
    at d = 0."""
    size = tl.abs(base)
    mag = tl.where(size == 1.0, 1.0, tl.exp(exp * tl.log(size)))   # (+-1)**inf = 1: not inf * 0
    mag = tl.where(exp == 1.0, size, tl.where(exp == 2.0, size * size,
                                               tl.where(exp == -1.0, 1.0 / size, mag)))
    even = tl.floor(exp * 0.5) * 2.0 == exp
    # a negative base: its integer powers signed, -inf's others as +inf's, the rest NaN
    signed = tl.where(exp == tl.floor(exp), tl.where(even, mag, -mag),
                      tl.where(base == -float("inf"), mag, float("nan")))
    # -0.0 (the only base >= 0 whose reciprocal is negative): its odd integer powers signed
    zero_signed = tl.where(exp == tl.floor(exp), tl.where(even, mag, -mag), mag)
    out = tl.where(base < 0.0, signed, tl.where(1.0 / base < 0.0, zero_signed, mag))
    return tl.where(exp == 0.0, 1.0, tl.where(base == 1.0, 1.0, out))


@triton.jit
def _sinh64(x):
    """sinh in float64: its series where |x| < 1e-2 (exp(x) - exp(-x) cancels there: at 1e-10
    it keeps six digits), the exponentials elsewhere (relative error about 1e-14 at 1e-2)."""
    x2 = x * x
    series = x * (1.0 + x2 * (1.0 / 6.0 + x2 * (1.0 / 120.0 + x2 * (1.0 / 5040.0 + x2 / 362880.0))))
    return tl.where(tl.abs(x) < 1e-2, series, 0.5 * (tl.exp(x) - tl.exp(-x)))


@triton.jit
def _cosh64(x):
    """cosh in float64 (a sum: nothing cancels)."""
    return 0.5 * (tl.exp(x) + tl.exp(-x))


@triton.jit
def _tanh64(x):
    """tanh in float64: its series where |x| < 1e-2, else 1 - 2 / (exp(2x) + 1), which is -1 or
    1 where exp overflows (the textbook quotient would be inf / inf)."""
    x2 = x * x
    series = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0 - x2 * 62.0 / 2835.0))))
    return tl.where(tl.abs(x) < 1e-2, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))



@triton.jit
def _fma_pair(x1, w1, x2, w2):
    """tl.reduce's combine for _row_dot: a pair (x, w) stands for x * w, and two of them
    combine into (x1 * w1 + x2 * w2, 1); on a partial sum (w = 1) the product folds away,
    so each element costs one FFMA."""
    return tl.fma(x2, w2, x1 * w1), tl.full(x1.shape, 1.0, tl.float32)

@triton.jit
def _row_dot(a, b):
    """sum_j a_ij * b_ij per row: one FFMA per element, where tl.sum(a * b, 1) would take an
    FMUL and an FADD (the kernels compile with contraction off). The interpreter calls a
    custom combine once per element in Python (seconds per tile), so it takes tl.sum: the
    same sum, rounded once more per element (see _ROW_DOT_FMA)."""
    if _ROW_DOT_FMA:
        return tl.reduce((a, b), 1, _fma_pair)[0]
    else:
        return tl.sum(a * b, 1)

@triton.jit
def _clamped(x):
    """x within float32's finite range. Next to a kink (|d - mu| a denormal) a parameter
    derivative can overflow float32 where dS is ~0: the largest float keeps dS * derivative
    finite, as the tables' clamped entries are. (A NaN becomes -3.4e38: see _clamped_sum.)"""
    return tl.minimum(tl.maximum(x, -3.4028234663852886e38), 3.4028234663852886e38)

@triton.jit
def _clamped_sum(x):
    """_clamped for a parameter's sums as they are stored, keeping a NaN a NaN: a row that an
    inf in v reached sums to NaN, which must reach the parameter's gradient as NaN (as autograd's
    does), not as the largest float, which a NaN check (GradScaler's) lets through. Once per
    row, not per score: the NaN-propagating clamp costs registers in the loop (FIRE's dQ at d64
    spilled on sm_90)."""
    return tl.clamp(x, -3.4028234663852886e38, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)

@triton.jit
def _table_load(ptrs):
    """A tile of distance-table entries, in the layout of the tile that reads them.

    tl.load would take a coalescing layout for a [BLOCK_M, BLOCK_N] gather and move the
    values into the MMA layout of the scores through shared memory (a store, a barrier and a
    load per entry: Triton keeps a load of more elements than threads in its own layout).
    The table is a few KB that every tile re-reads from L1, so coalescing buys nothing; an
    elementwise ld.global.nc lets the compiler issue the load in the consumer's layout."""
    if _TABLE_PTX:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.load(ptrs)

@triton.jit
def _gather_table(ptrs, TABLE_GATHER: tl.constexpr):
    """The forward's tile of table entries, read as TABLE_GATHER says (tiles.FWD_TABLE_GATHER):
    "async" through tl.load (the pipeliner's asynchronous copy), "coalesced" the same from a
    pointer tensor of another shape, "direct" through _table_load ("prefetch": the same, where
    the entries are not read a tile ahead: positions from tensors; forward._attn_fwd_inner
    reads ahead itself, for the forward and for the decode kernel when one pins it)."""
    if TABLE_GATHER == "direct" or TABLE_GATHER == "prefetch":
        return _table_load(ptrs)
    elif TABLE_GATHER == "coalesced":
        # the pointers as [M, 1, N]: a shape no other load or store of the kernel has, so that
        # Triton's coalescing pass gives the copy a layout of its own (a warp reads 32
        # consecutive entries of a row) instead of Q's (see tiles.FWD_TABLE_GATHER)
        M: tl.constexpr = ptrs.shape[0]
        N: tl.constexpr = ptrs.shape[1]
        return tl.reshape(tl.load(tl.expand_dims(ptrs, 1)), (M, N))
    else:
        return tl.load(ptrs)

@triton.jit
def _table_load4(ptrs):
    """Four consecutive table entries at each of a tile's 16-byte aligned pointers (the dQ
    kernel's interleaved table: the log-prior and its derivatives of one distance), in one
    vector load and one address, in the tile's layout (see _table_load)."""
    if _TABLE_PTX:
        return tl.inline_asm_elementwise("ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];",
                                         "=r,=r,=r,=r,l", [ptrs],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs), tl.load(ptrs + 1), tl.load(ptrs + 2), tl.load(ptrs + 3)

@triton.jit
def _lowp(x, dtype: tl.constexpr):
    """x (float32) in the inputs' dtype, rounded to nearest even as a GPU rounds it (cvt.rn).
    The Triton 3.9 interpreter truncates a float32 -> bfloat16 cast (its cast_impl passes no
    rounding mode; float16 goes through numpy and rounds): with P in one FFMA the row max's P
    is 1 - 6e-8, which it cut to 0.996 for the P @ V product, 0.4% off O where a GPU has 1
    (docs/reliability.md, "Interpreter rounding"). So under the interpreter a bfloat16 result
    is rounded here: the upper half of the bits, plus half an ulp and the tie to even (a NaN is
    cast as it is); on a GPU this is the plain cast."""
    if _BF16_RN_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        return tl.where(x != x, x.to(dtype), rounded.to(tl.bfloat16, bitcast=True))
    else:
        return x.to(dtype)


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + a @ b (see UPCAST_DOT)."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _ramp_reference(rows_abs, last_key, first_key, slope):
    """The key a causal ramp's scores are measured from, for each row at rows_abs (forward,
    decode and backward alike): the nearest key it can see, min(i, last key), where the prior falls with
    the distance (slope <= 0), else the first key. Measured from there, the scores that
    carry the weight stay small numbers whatever the positions: queries at 2**20 against
    keys 0..255 have absolute logits -|d|/b near -3e5, which float32 rounds to 1/32, far
    coarser than the q.k it would add them to."""
    return tl.where(slope > 0.0, first_key, tl.minimum(rows_abs, last_key))

@triton.jit
def _ramp_row_term(rows_abs, row_ref, slope, intercept, row_abs):
    """What a row's base-2 logits hold beyond s + slope * (row_ref - j): the row's constant
    intercept + slope * (i - row_ref), counted only where absolute statistics are asked
    for (row_abs 1.0: forward_block's blocks are merged by them), else 0."""
    return row_abs * (intercept + slope * (rows_abs - row_ref).to(tl.float32))


@triton.jit
def _ramp_nearest_key(rows_abs, last_key, first_key):
    """Without the causal mask, for a ramp even in d (ALiBi's -|d|/b): each row's nearest
    key, from which its scores are measured (_ramp_logit2): queries at 2**23 against keys
    at 2**24 have absolute logits -|d|/b near -1e8, which float32 rounds in steps of 8."""
    return tl.minimum(tl.maximum(rows_abs, first_key), last_key)

@triton.jit
def _ramp_nearest_row_term(rows_abs, near, slope, intercept, row_abs):
    """_ramp_row_term for scores measured from the rows' nearest keys (_ramp_logit2): the
    row's constant intercept + slope * |i - near|."""
    return _ramp_row_term(rows_abs, rows_abs - tl.abs(rows_abs - near), slope, intercept, row_abs)

@triton.jit
def _ramp_logit2(qk, qk_scale, slope, rows_abs, keys_abs, row_ref):
    """Base-2 logits measured from the rows' nearest keys, s + slope * (|d| - |d_ref|), for
    a ramp even in d (|d| - |d_ref| is exact: positions stay within 2**24); every kernel
    computes them here, bit for bit alike."""
    rel = tl.abs(rows_abs - keys_abs) - tl.abs(rows_abs - row_ref)
    return tl.fma(rel.to(tl.float32), slope, qk * qk_scale)


@triton.jit
def _kv_bases(K, V, off_b, off_hk, k_start, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
              stride_vn, Hq, GROUP, KV_TMA: tl.constexpr):
    """(k_base, v_base, kv_row): where this program's keys and values start (its batch row, KV
    head and first key k_start), for _load_kv; with KV_TMA, K and V are tensor descriptors
    over [B * Hk, Nk, D] (launch.kv_descriptors), returned as they are, and kv_row is the
    program's row of them (its keys start at 0: launch.kv_tma takes no packed documents)."""
    if KV_TMA:
        return K, V, off_b * (Hq // GROUP) + off_hk
    else:
        k_base = (K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
                  + tl.cast(k_start, tl.int64) * stride_kn)
        v_base = (V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
                  + tl.cast(k_start, tl.int64) * stride_vn)
        return k_base, v_base, 0

@triton.jit
def _load_kv(base, offs_n, stride_n, offs_d, Nk, MASK_KEYS: tl.constexpr, D: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    """A [BLOCK_N, HEAD_DIM] tile of K or V, contiguous along the head dim (vector loads);
    masked only where keys (MASK_KEYS) or the padded head dim can run out."""
    ptrs = base + offs_n[:, None] * stride_n + offs_d[None, :]
    if MASK_KEYS:
        return tl.load(ptrs, mask=(offs_n < Nk)[:, None] & (offs_d < D)[None, :], other=0.0)
    elif D < HEAD_DIM:
        return tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    else:
        return tl.load(ptrs)

@triton.jit
def _load_kept(base, offs_n, stride_n, offs_d, kept, D: tl.constexpr):
    """A [BLOCK_N, HEAD_DIM] tile of K or V under key_mask: the padding keys read as 0, so
    that a NaN stored in a padding key reaches no output (P is 0 there, and 0 * NaN is NaN)."""
    return tl.load(base + offs_n[:, None] * stride_n + offs_d[None, :],
                   mask=kept[:, None] & (offs_d < D)[None, :], other=0.0)

@triton.jit
def _kept_keys(km_base, offs_n, Nk):
    """key_mask over a tile of keys (False past Nk): km_base points at the row's first key."""
    return tl.load(km_base + offs_n, mask=offs_n < Nk, other=0) != 0

@triton.jit
def _row_offsets(QOff, KOff, off_b, q_offset, k_offset, ROW_OFFSETS: tl.constexpr):
    """(q_offset, k_offset) of batch row off_b: the scalars, or with ROW_OFFSETS the row's
    entries of the int32 tensors [B] (left padding, generation)."""
    if ROW_OFFSETS:
        return tl.load(QOff + off_b), tl.load(KOff + off_b)
    else:
        return q_offset, k_offset

@triton.jit
def _program_span(Work, CuSeqQ, CuSeqK, pid, Nq, Nk, VARLEN: tl.constexpr):
    """(tile, q_start, Nq, k_start, Nk) of a program: its tile index among the rows (or keys)
    it works on, and the rows and keys it lives in, as (first, count). Plain: program pid
    works on tile pid of all Nq rows and Nk keys. VARLEN (packed documents): Work[pid] =
    (document, tile), and the rows and keys are that document's (CuSeqQ, CuSeqK: cumulative
    lengths): positions, masks and bounds are then local to the document, and the tiles of
    other documents are never visited."""
    if VARLEN:
        doc = tl.load(Work + 2 * pid)
        q_start = tl.load(CuSeqQ + doc)
        k_start = tl.load(CuSeqK + doc)
        return (tl.load(Work + 2 * pid + 1), q_start, tl.load(CuSeqQ + doc + 1) - q_start,
                k_start, tl.load(CuSeqK + doc + 1) - k_start)
    else:
        return pid, pid * 0, Nq, pid * 0, Nk

@triton.jit
def _window_keys(Window, off_h, row0, ROWS: tl.constexpr, n_hi, BLOCK_N: tl.constexpr):
    """[n_lo, n_hi) of the keys that rows row0 .. row0 + ROWS - 1 (query positions minus
    k_offset) can see through this head's window [lo, hi] of distances (Window[h] =
    (lo, hi), from the prior's table); n_lo is rounded down to a tile."""
    lo = tl.load(Window + off_h * 2)
    hi = tl.load(Window + off_h * 2 + 1)
    n_lo = tl.minimum(tl.maximum(row0 - hi, 0), n_hi) // BLOCK_N * BLOCK_N
    n_hi = tl.minimum(n_hi, tl.maximum(row0 + ROWS - lo, 0))
    return n_lo, n_hi

@triton.jit
def _steady_keys(first_row, Nq, Nk, q_offset, k_offset, n_lo, n_hi, CAUSAL: tl.constexpr,
                 SKIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WHOLE_ROWS: tl.constexpr):
    """n_full: the key tiles [n_lo, n_full) are seen whole by every row of the query tile
    whose first row is first_row (counted from the program's first row, offsets apart): the
    steady state, which needs no causal or bounds mask; the rest, [n_full, n_hi), holds the
    diagonal and the ragged end. WHOLE_ROWS: the steady state also needs every row of the tile
    to exist (a kernel that sums over its rows: the dQ kernel's parameter sums), else it is
    empty."""
    n_full = Nk // BLOCK_N * BLOCK_N
    if CAUSAL:
        first_row_keys = tl.minimum(tl.maximum(first_row + q_offset - k_offset + 1, 0), Nk)
        n_full = first_row_keys // BLOCK_N * BLOCK_N
    if SKIP:
        # the steady state ends at a whole tile inside [n_lo, n_full) (keys there exist and are
        # visible, so a tile may reach past the window: those scores are computed exactly)
        n_full = tl.maximum(n_lo, tl.minimum(n_full, tl.cdiv(n_hi, BLOCK_N) * BLOCK_N))
    if WHOLE_ROWS:
        n_full = tl.where(first_row + BLOCK_M <= Nq, n_full, n_lo)
    return n_full

@triton.jit
def _steady_query_tiles(first_key, Nq, Nk, q_offset, k_offset, m_start, m_end,
                        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(m_mid_lo, m_mid_hi): of the query tiles [m_start, m_end) that the dK/dV kernel walks for
    the key tile at first_key, those in [m_mid_lo, m_mid_hi) exist whole and see every key of
    the tile (the steady state, no mask); [m_start, m_mid_lo) holds the diagonal, [m_mid_hi,
    m_end) the ragged end. A key tile past Nk has none: both are m_start."""
    m_lo = m_start
    m_hi = m_start
    if first_key + BLOCK_N <= Nk:
        first = m_start
        if CAUSAL:   # the first row that sees the tile's last key
            first = tl.maximum(m_start, first_key + BLOCK_N - 1 + k_offset - q_offset)
        tiles_end = tl.cdiv(m_end, BLOCK_M) * BLOCK_M
        m_lo = tl.minimum(m_start + tl.cdiv(first - m_start, BLOCK_M) * BLOCK_M, tiles_end)
        m_hi = tl.maximum(m_lo, tl.minimum(Nq // BLOCK_M * BLOCK_M, tiles_end))
    return m_lo, m_hi

@triton.jit
def _softmax_stats(Mrow, Lrow, offsets, row_ok):
    """(m, 1/l) of the forward's softmax for a tile of rows; 0 and 0 for a row that saw no
    key, so that P = exp2(z - m) / l is 0 there."""
    m_row = tl.load(Mrow + offsets, mask=row_ok, other=0.0)
    l_row = tl.load(Lrow + offsets, mask=row_ok, other=0.0)
    m_row = tl.where(m_row == -float("inf"), 0.0, m_row)
    inv_l = tl.where(l_row == 0.0, 0.0, 1.0 / tl.where(l_row == 0.0, 1.0, l_row))
    return m_row, inv_l


# ----------------------------------------------------------------------------------------
# The logit of a tile as every kernel computes it. The backward rebuilds P = exp2(z - m) / l
# from the forward's row statistics, so z must come out bit for bit the same in every kernel:
# they all take it from here. A separate logit expression may round differently ((a * b) * c
# against a * (b * c)), and where |z| is huge (a row far from the head's best distance: 4e13)
# one rounding step is 2**22, exp2 of which overflows.
# ----------------------------------------------------------------------------------------
@triton.jit
def _logit_grads(s, pos_d, pos_i, pos_j, pos_n, tab, sc):
    """(logit, d logit / d s, d logit / d p per learnable p) of a score other than
    s + log_prior. With a table, a log-prior of -inf hides its key whatever the score makes of
    it: SSMax's (s - inf) * log(n) is NaN for a row that sees one key (log 1 = 0)."""
    out = prior_grads(s, pos_d, pos_i, pos_j, pos_n, tab, sc)
    if TABLE:
        return (tl.where(tab[0] == -float("inf"), -float("inf"), out[0]),) + out[1:]
    else:
        return out


@triton.jit
def _value_entries(tab_v):
    """A tile's table entries where only the log-prior is read: tab_v in every slot (the
    derivative slots are not read there, and the compiler drops what they would feed)."""
    tab = (tab_v,)
    for _ in tl.static_range(TABLE_SLOTS - 1):
        tab = tab + (tab_v,)
    return tab


@triton.jit
def _finite_row(x, pos_n):
    """x as a vector like pos_n, infinite entries 0 (see _row_factors); NaN stays."""
    x = x + tl.zeros_like(pos_n)
    return tl.where(tl.abs(x) == float("inf"), 0.0, x)


@triton.jit
def _row_factors(pos_i, pos_n, sc):
    """(d logit / d s, then each learnable parameter's row factor) for a vector of query rows:
    the parts of the derivatives that are constant along a row (ROW_FACTORS). A factor that is
    infinite is 0: it occurs only in a row that sees no key (SSMax's log 0), where every P, dS
    and per-score sum is 0 and 0 * inf would be NaN."""
    out = prior_row_factors(pos_i, pos_n, sc)
    rows = ()
    for g in tl.static_range(len(out)):
        rows = rows + (_finite_row(out[g], pos_n),)
    return rows


@triton.jit
def _logit_row2(pos_i, pos_n, sc):
    """log2(e) times the logit's row factor r (the logit is u * r, ROW_FACTORS), for rows or a
    vector of them: every kernel computes it once per row, outside its key loop, with the same
    operations, so the forward and the backward's rebuilt P agree bit for bit."""
    # (+ 0 * pos_n: a row factor of the parameters alone, such as a temperature t, is a
    # scalar; the kernels index it as a vector of rows)
    return (prior_logit_row(pos_i, pos_n, sc) + tl.zeros_like(pos_n)) * 1.4426950408889634  # log2(e)


@triton.jit
def _factored_logit2(qk, sm_scale, logit_r2, pos_d, pos_i, pos_j, pos_n, tab, sc):
    """(log2(e) * logit, u) for a tile of raw q.k products: z = u * logit_r2 (_logit_row2's),
    one multiply per score, and with LOGIT_FMA u = s + v one FFMA."""
    if LOGIT_FMA:
        u = tl.fma(qk, sm_scale, prior_logit_score(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, tab, sc))
    else:
        u = prior_logit_score(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, tab, sc)
    z = u * logit_r2
    if TABLE:
        z = tl.where(tab[0] == -float("inf"), -float("inf"), z)   # (see _logit_grads)
    return z, u


@triton.jit
def _table_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_v, sc):
    """log2(e) * logit for a tile of raw q.k products, from the tile's log-prior entries tab_v
    (table strategy): every kernel's logit comes from here, through _logit2 or, in the dQ
    kernel, from its interleaved table."""
    if SCORE_IS_S:
        # the table holds log2(e) * log_prior (launch.base2_log_prior): one FFMA per score, as
        # NoPE's qk * qk_scale is one FMUL
        return tl.fma(qk, qk_scale, tab_v)
    elif ROW_FACTORS:
        return _factored_logit2(qk, sm_scale, _logit_row2(pos_i, pos_n, sc), pos_d, pos_i, pos_j,
                                pos_n, _value_entries(tab_v), sc)[0]
    else:
        # (the derivatives are unused, the compiler drops them)
        logit = _logit_grads(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, _value_entries(tab_v), sc)[0]
        return logit * 1.4426950408889634  # log2(e)


# P of a scaled score. Where the logit is q.k * qk_scale alone (SCALED_SCORE, hooks.py:
# SCORE_IS_S without a bias, a table or a ramp: NoPE), every kernel computes P = exp2(fma(q.k, qk_scale, -m)): one FFMA a
# score, rounded once where the product and the difference were rounded each (Triton's
# tutorial computes it so), and the same expression in the forward, decode, dK/dV and dQ
# kernels, so the backward rebuilds the forward's bits. The forward takes the row's max on q.k
# and scales it once: max(q.k) * qk_scale is bit for bit the max of the rounded products
# (rounding is monotone, and qk_scale > 0: checks.py refuses any other scale). Written inline
# in each kernel: called as a function it reordered the other priors' SASS.
@triton.jit
def _logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_ptrs, sc):
    """log2(e) * logit for a tile of raw q.k products: the softmax runs in base 2 (exp2).
    qk_scale = sm_scale * log2(e); tab_ptrs point at the tile's table entries (table strategy;
    unused otherwise)."""
    if TABLE:
        # tl.load: Triton's pipeliner turns this load into an asynchronous copy (the
        # backward's rebuilt P in some branches; the forward and decode loops read their
        # entries as TABLE_GATHER says, _gather_table, and the backward's gradients gather
        # with _table_load)
        return _table_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tl.load(tab_ptrs), sc)
    elif SCORE_IS_S and HAS_BIAS:
        return (qk * sm_scale + prior_bias(pos_d, pos_i, pos_j, pos_n, sc)) * 1.4426950408889634
    elif SCORE_IS_S:
        return qk * qk_scale
    elif ROW_FACTORS:
        return _factored_logit2(qk, sm_scale, _logit_row2(pos_i, pos_n, sc), pos_d, pos_i, pos_j,
                                pos_n, (), sc)[0]
    else:
        logit = _logit_grads(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, (), sc)[0]
        return logit * 1.4426950408889634  # log2(e)
