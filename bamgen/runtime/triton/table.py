"""A call's distance table built on the device in two launches (docs/architecture.md, "Distance
table").

tables.prior_tables builds the table with torch: the printed formula over every distance in
float64, the shift per head, the derivatives masked and clamped, then one rounding. On a GPU that
is a launch per operation, 38 for GGD and 54 for T5 (232 in T5's training step), paid by every
call and every generation step (docs/performance.md, "What a call launches"). This kernel does
the same in two launches over (head, CHUNK entries) programs, through the prior's
prior_distance hook (its formula printed in float64 Triton: hooks.py):

  pass 1, _table_shift_parts (SHIFT) over the entries of the distances the call's queries can
         see, [t_lo, t_hi]: each part's largest finite log-prior, its first entry
         (torch.argmax's) and whether any is NaN
  pass 2, _distance_table over every entry: the head's shift from pass 1's parts, then
         value - shift and each derivative minus its value at the shift's entry, 0 where the
         value is -inf, clamped to float32's range; stored in Out's dtype

(One program per head would do both passes in one launch, but a head's distances one block at
a time: 16 programs for a whole GPU, and a 128k-token call's 256k entries in series.)

The values agree with the torch build's to the last bit of float64 but for the special
functions (log, exp, powers), whose float64 results may differ by an ulp between libraries:
after the rounding to float32, a rare entry moves by one float32 ulp.

Flags (tl.constexpr):
  SLOTS   entries stored per distance: 1 (the value alone: a call without a backward) or the
          prior's TABLE_SLOTS
  SHIFT   shift each head by its largest visible log-prior (tables.shift_tables); off for the
          block API, whose blocks must share their reference, and where no distance is visible
  BASE2   store the value slot in base 2, log2(e) times its float32 rounding, as
          launch.base2_log_prior does (a logit s + log_prior)
  CHUNK   entries per program
  BLOCK   entries per step
"""
import triton
import triton.language as tl

from .. import constants
from .hooks import prior_distance   # (the prior's own in its variant: variant.py)

FLOAT32_MAX = tl.constexpr(constants.FLOAT32_MAX)
LOG2E = tl.constexpr(constants.LOG2E)
INF = tl.constexpr(float("inf"))


@triton.jit
def _entries(d_top, t, Theta_h):
    """The table's entries at entries t (distance d_top - t), each a float64 tile like t."""
    out = ()
    zeros = tl.zeros(t.shape, tl.float64)
    raw = prior_distance((d_top - t).to(tl.float64), Theta_h)
    for s in tl.static_range(len(raw)):
        out = out + (raw[s] + zeros,)    # (a constant derivative is a scalar)
    return out


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) < INF)


@triton.jit
def _visible_best(Theta_h, d_top, t_lo, t_hi, BLOCK: tl.constexpr):
    """(the largest finite value over entries [t_lo, t_hi], its first entry (t_lo where none is
    finite, as argmax of all -inf), whether any value there is NaN)."""
    best = tl.full([], -INF, tl.float64)
    best_t = t_lo
    nan = tl.full([], 0, tl.int32)
    for start in range(t_lo, t_hi + 1, BLOCK):
        t = start + tl.arange(0, BLOCK)
        inside = t <= t_hi
        value = _entries(d_top, t, Theta_h)[0]
        finite = tl.where(inside & _finite(value), value, -INF)
        top = tl.max(finite, 0)
        first = tl.min(tl.where(finite == top, t, t_hi + 1), 0)
        best, best_t = _first_best(best, best_t, top, first)
        nan = nan | tl.max((inside & (value != value)).to(tl.int32), 0)
    return best, best_t, nan


@triton.jit
def _first_best(best, best_t, value, t):
    """(best, best_t) after (value, t), which comes later in table order: as torch.argmax, the
    first of equal values is kept."""
    return tl.maximum(best, value), tl.where(value > best, t, best_t)


@triton.jit
def _at(Theta_h, d_top, t):
    """The entries at the one entry t, as float64 scalars."""
    lane = tl.arange(0, 2)
    raw = _entries(d_top, t + lane * 0, Theta_h)
    out = ()
    for s in tl.static_range(len(raw)):
        out = out + (tl.sum(tl.where(lane == 0, raw[s], 0.0), 0),)
    return out


@triton.jit
def _table_shift_parts(Theta, stride_theta_h, Best, BestT, Nan, d_top, t_lo, t_hi, num_parts,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1, one program per (head, CHUNK entries of [t_lo, t_hi]): _visible_best of its
    entries into Best, BestT, Nan [Hq, num_parts]."""
    h = tl.program_id(0)   # (int32: theta and the parts are small)
    part = tl.program_id(1)
    start = t_lo + part * CHUNK
    best, best_t, nan = _visible_best(Theta + h * stride_theta_h, d_top, start,
                                      tl.minimum(start + CHUNK - 1, t_hi), BLOCK)
    tl.store(Best + h * num_parts + part, best)
    tl.store(BestT + h * num_parts + part, best_t)
    tl.store(Nan + h * num_parts + part, nan)


@triton.jit
def _distance_table(Theta, stride_theta_h, Out, stride_out_h, stride_out_s, Best, BestT, Nan,
                    num_parts, d_top, n_dist, t_lo, SLOTS: tl.constexpr, SHIFT: tl.constexpr,
                    BASE2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2, one program per (head, CHUNK entries): Out[h, s, t], entry s of distance
    d_top - t, shifted by the head's best of pass 1's parts (the first part's first entry
    among equals, as argmax)."""
    h = tl.program_id(0).to(tl.int64)   # (a head's offset passes 2**31 for T5 at 1M tokens)
    Theta_h = Theta + h * stride_theta_h
    Out_h = Out + h * stride_out_h
    shift = tl.full([], 0.0, tl.float64)
    if SHIFT:
        best = tl.full([], -INF, tl.float64)
        best_t = t_lo
        nan = tl.full([], 0, tl.int32)
        for part in range(0, num_parts):
            best, best_t = _first_best(best, best_t, tl.load(Best + h * num_parts + part),
                                       tl.load(BestT + h * num_parts + part))
            nan = nan | tl.load(Nan + h * num_parts + part)
        # a head that sees no finite value keeps its values (no -inf - -inf); a NaN parameter
        # keeps its NaN (a NaN shift), for the output to show it
        shift = tl.where(best == -INF, 0.0, best)
        shift = tl.where(nan > 0, float("nan"), shift)
        at_best = _at(Theta_h, d_top, best_t)
    chunk = tl.program_id(1) * CHUNK
    for start in range(chunk, tl.minimum(chunk + CHUNK, n_dist), BLOCK):
        t = start + tl.arange(0, BLOCK)
        inside = t < n_dist
        entries = _entries(d_top, t, Theta_h)
        value = entries[0] - shift
        stored = value.to(Out.dtype.element_ty)
        if BASE2:
            stored = (stored.to(tl.float64) * LOG2E).to(Out.dtype.element_ty)
        tl.store(Out_h + t, stored, mask=inside)
        live = value > -INF
        for s in tl.static_range(1, SLOTS):
            grad = entries[s]
            if SHIFT:   # (the shift's gradient is 0: tables.shift_tables)
                grad = grad - tl.where(_finite(at_best[s]), at_best[s], 0.0)
            grad = tl.where(live, grad, 0.0)
            # clamped, a NaN kept (tl.minimum would drop it)
            grad = tl.where(grad > FLOAT32_MAX, FLOAT32_MAX, tl.where(grad < -FLOAT32_MAX, -FLOAT32_MAX, grad))
            tl.store(Out_h + s * stride_out_s + t, grad.to(Out.dtype.element_ty), mask=inside)
