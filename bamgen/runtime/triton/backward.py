"""The backward kernels, written once for every prior (the prior enters through hooks.py):
_bwd_preprocess (delta = rowsum(dO * O), and each row's softmax statistics as the dK/dV
kernel reads them), _attn_bwd_dkdv (one program per key tile, the query
tiles in its loop) and _attn_bwd_dq (one program per query tile; also the parameters'
gradients: one partial sum per program, summed on the host, no atomics).

Constexpr flags of the launch:
  NUM_PARAMS, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, D, DOT_PREC, UPCAST_DOT  as in the forward
  NUM_GRADS    learnable scalars; the dQ kernel writes NUM_GRADS partial sums per program
  GRAD_BASE, GRAD_COUNT  (dQ) the learnable scalars this launch sums, GRAD_BASE to
               GRAD_BASE + GRAD_COUNT - 1: a prior with many (FIRE's 99 weights) takes one
               launch per group of GRAD_GROUP (launch.py), each with the registers of a few;
               the launch of the first group alone writes dQ
  DIST_SUMS, DIST_K  (dQ; PriorTraits.dist_sums, not with ROW_SUMS) a table prior's gradients
               from per-distance sums of dS: each key tile's dS, skewed so that its diagonals
               (one distance each) become columns, is summed per distance and contracted with
               the derivative tables (DIST_K >= NUM_GRADS columns, a power of two): one launch
               and a cost that hardly grows with the parameter count (T5's 32 buckets)
  HAS_KEY_MASK, ROW_OFFSETS, VARLEN  as in the forward; with VARLEN the dK/dV kernel's Work
               lists (document, key tile) items and the dQ kernel's (document, query tile)
  ROW_SUMS     (dQ) the keys are one block of the row's (backward_block): the per-row
               correction of the parameter gradients is left to the caller, and the row sums
               it needs are written to RowSums; DPosQ gets the raw sums (no correction)
  DS_ROWS_KNOWN (dQ; derived: GRAD_BASE > 0, not ROW_SUMS, VARLEN or POSITIONS) a later
               group's launch: the first group's launch wrote each row's sum of dS to RowSums
               (DS_ROWS_STORE), so each parameter takes one accumulator,
               sum_j (dS - rowsum(dS) P) g, not two
  TILE_GRAD_SUMS (dQ, with ROW_FACTORS; derived: BLOCK_M * BLOCK_N >= 2048) the parameters'
               sums dS * g are reduced per key tile into [BLOCK_M] vectors instead of
               [BLOCK_M, BLOCK_N] accumulators
  DS_ON_P      (dK/dV; derived: ROWS_READY and not RAMP) dS is selected where P is not 0, not
               on the mask: no mask is kept across the dP product
  SPLIT_STEADY (dQ: tiles.splits_steady) the key tiles that every row of a whole query tile
               sees whole run first through a loop with no causal or bounds mask (the
               forward's steady state); off, one masked loop walks every tile (fewer
               registers: the split spills where the loop is near 255). (dK/dV:
               tiles.splits_steady) on the query tiles whose rows all exist and see every key
               of the tile, between the diagonal's and the ragged end's, a uniform branch in
               the one loop skips the mask's select on P
The prior's flags (hooks.py) decide the rest: with ROWS_READY the dK/dV kernel reads each row's
m and 1/l as _bwd_preprocess made them (RowM, RowL), else the forward's m and l there; with
ROW_FACTORS dQ sums the per-score parts of
the derivatives and applies each row's factors after its key loop, dK/dV folds d logit / d s
into the row term, and every logit is _factored_logit2's; ROW_CACHE: _bwd_preprocess writes each
row's (log2(e) * logit factor, d logit / d s) to RowF for dK/dV; TABLE_WIDTH: the dQ kernel's
interleaved table (the log-prior and each derivative of a distance side by side, groups of four:
one _table_load4 per group); TILE_ROW_SUMS: the correction's row sums are reduced per key tile
into [BLOCK_M] vectors, which frees registers for wider tiles; otherwise they accumulate in
[BLOCK_M, BLOCK_N] registers like the gradients.
The backward kernels gather table entries with _table_load (PTX, in the MMA layout), the forward
with tl.load (see helpers.py).
With POSITIONS both kernels sum the positions' gradients (DPosK, DPosQ) unless TABLE_POSITIONS
(integer positions, which take none: POS_GRADS is off), whose scores read the table at their
positions' distance.
Runtime: as in the forward, row_abs included (Mrow's reference, see forward.py): where the prior
is a causal ramp, both kernels measure a row's scores from its own reference key
(_ramp_reference) as the forward's statistics are, and the dQ kernel its parameter derivatives
too (without ROW_SUMS).
"""
import triton
import triton.language as tl

from .helpers import (
    TABLE_ROW_ARGS, _as_cols, _as_rows, _clamped, _clamped_sum, _distance, _dot, _factored_logit2, _fp32_scalars,
    _kept_keys, _load_kv,
    _logit2, _logit_grads, _logit_row2, _lowp, _own_distance, _position, _position_diff, _position_reduce,
    _position_terms, _store_positions, _tensor_positions, _zero_tiles, _ramp_logit2, _ramp_nearest_key, _ramp_nearest_row_term, _ramp_reference,
    _ramp_row_term, _program_span, _row_dot, _row_factors, _row_offsets, _softmax_stats,
    _steady_keys, _steady_query_tiles, _table_load, _table_load4, _table_logit2, _value_entries, _window_keys)
from .hooks import (  # noqa: F401 (each prior's kernels get its own: variant.py)
    CENTER_GRADS, GRAD_MODES, POSITION_GRADS, POSITIONS, RAMP, RAMP_SYMMETRIC, ROW_CACHE, ROW_FACTORS, ROWS_READY,
    SCALED_SCORE, SCORE_IS_S, SKIP, TABLE, TABLE_POSITIONS, TABLE_WIDTH, TILE_ROW_SUMS, prior_grads, prior_position_grads, prior_ramp,
    prior_scalars, prior_score_factors)

GRAD_TABLE = tl.constexpr(1)          # (bamgen.runtime.traits: GRAD_TABLE, GRAD_LOGIT_FACTOR)
GRAD_LOGIT_FACTOR = tl.constexpr(2)


@triton.jit
def _bwd_row_stats(m_row, inv_l, delta):
    """(m, 1/l, delta) of a tile of rows as the dK/dV kernel uses them, P = exp2(z - m) / l and
    dS = P (dP - delta), from _softmax_stats and delta. A row that a NaN reached (a NaN logit:
    its l and delta are NaN, and m may be) gets m = inf, 1/l = 1 and delta = 0: P = 0 and
    dS = 0 for every key whose logit is a number or -inf, NaN for a key whose logit is NaN; a
    key its prior hides (-inf, float32's overflow included) gets no NaN from it."""
    poisoned = inv_l != inv_l
    m_row = tl.where(poisoned, float("inf"), m_row)
    inv_l = tl.where(poisoned, 1.0, inv_l)
    delta = tl.where(poisoned, 0.0, delta)
    return m_row, inv_l, delta


@triton.jit
def _bwd_preprocess(O, DO, Mrow, Lrow, Delta, RowM, RowInvL, Theta, NRow, RowF, stride_ob,
                    stride_oh, stride_om, stride_dob, stride_doh, stride_dom, stride_nb, Hq, Nq,
                    NUM_PARAMS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D: tl.constexpr):
    """Delta = rowsum(dO * O), the softmax backward's row term (0 for a row that a NaN reached:
    _bwd_row_stats), and with ROWS_READY each row's m and 1/l as the dK/dV kernel takes them
    (RowM, RowInvL); with ROW_CACHE also each row's factors for the dK/dV kernel (RowF[b, h,
    row] = (log2(e) * the logit's row factor, d logit / d s)). That kernel revisits every row
    once per key tile: 1/l there (a full-range division) and the poisoned rows' selects were
    about 120 of NoPE's 670 instructions a pass at head dim 64, SSMax's log(n) (about 20
    instructions per row) as much as the scores."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    mask = row_ok[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = pid_bh.to(tl.int64) * Nq + offs_m
    m_row, inv_l = _softmax_stats(Mrow, Lrow, rows, row_ok)
    m_row, inv_l, delta = _bwd_row_stats(m_row, inv_l, delta)
    tl.store(Delta + rows, delta, mask=row_ok)
    if ROWS_READY:
        tl.store(RowM + rows, m_row, mask=row_ok)
        tl.store(RowInvL + rows, inv_l, mask=row_ok)
    if ROW_CACHE:
        sc = prior_scalars(Theta + off_h * NUM_PARAMS)
        n_rows = tl.load(NRow + off_b.to(tl.int64) * stride_nb + offs_m, mask=offs_m < Nq, other=0.0)
        pos_i = offs_m.to(tl.float32)   # (unread: the cached row factors do not use i)
        at = RowF + (pid_bh.to(tl.int64) * Nq + offs_m) * 2
        # the same functions as the forward's and the dQ kernel's: the same bits
        tl.store(at, _logit_row2(pos_i, n_rows, sc), mask=offs_m < Nq)
        tl.store(at + 1, _row_factors(pos_i, n_rows, sc)[0], mask=offs_m < Nq)


@triton.jit(do_not_specialize=TABLE_ROW_ARGS)
def _attn_bwd_dkdv(Q, K, V, Theta, DO, RowM, RowL, Delta, RowF, DK, DV, Table, Window, NRow,
                   KeyMask, QOff, KOff, CuSeqQ, CuSeqK, Work, PosQ, PosK, DPosK,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                   stride_dkb, stride_dkh, stride_dkn,
                   Hq, Hk, GROUP, Nq, Nk, q_offset, k_offset, sm_scale, d_top_b, tab_slot, tab_stride_h, stride_nb,
                   stride_mb, row_abs,
                   NUM_PARAMS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
                   DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                   ROW_OFFSETS: tl.constexpr, VARLEN: tl.constexpr, SPLIT_STEADY: tl.constexpr):
    """One program: one key tile of one (batch, kv head); loops over the GQA group's query
    heads and every query tile that can see it, so dK and dV need no atomics (POSITIONS: and
    each query head's column sums for the keys' positions, DPosK)."""
    sm_scale, row_abs = _fp32_scalars(sm_scale, row_abs)   # (fp64 under inductor)
    POS_GRADS: tl.constexpr = POSITIONS > 0 and not TABLE_POSITIONS and POSITION_GRADS
    # RowM, RowL: with ROWS_READY (hooks.py) each row's m and 1/l as _bwd_preprocess made them,
    # and dS is selected on P != 0 (below) unless the prior is a ramp; without (the positional
    # kernels), the forward's m and l, the rows' statistics made per query tile and dS selected
    # on the mask: with the leaner loop ptxas cut their registers to the next occupancy step
    # (168 or 128 a thread) and put 8-24 bytes on the stack, and their loops are bound by the
    # positions' work (docs/performance.md, "The dK/dV loop's row statistics").
    DS_ON_P: tl.constexpr = ROWS_READY and not RAMP
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hk
    off_hk = pid_bh % Hk
    rows_all = Nq   # the row stride of the statistics: every row of the call
    keys_all = Nk
    # this program's key tile, and the rows and keys it lives in (a document's, VARLEN)
    pid_n, q_start, Nq, k_start, Nk = _program_span(Work, CuSeqQ, CuSeqK, tl.program_id(0), Nq,
                                                    Nk, VARLEN)
    q_offset, k_offset = _row_offsets(QOff, KOff, off_b, q_offset, k_offset, ROW_OFFSETS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < Nk
    d_ok = offs_d < D
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
                + k_start.to(tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
                + k_start.to(tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    offs_n_abs = offs_n + k_offset
    if POSITIONS == 0:   # (position tensors: per query head, in the loop below)
        pos_j = _position(offs_n_abs)[:, None]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e)
    m_lo = 0
    if CAUSAL:  # the first query tile holding a row that sees this key tile
        m_lo = tl.maximum(pid_n * BLOCK_N + k_offset - q_offset, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        off_bh = off_b * Hq + off_h
        sc = prior_scalars(Theta + off_h * NUM_PARAMS)
        if RAMP:
            ramp = prior_ramp(sc)
            ramp_slope = ramp[0]
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
        do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh + q_start.to(tl.int64) * stride_dom
        row_base = off_bh.to(tl.int64) * rows_all + q_start   # this head's rows in RowM, RowL, Delta
        if POSITIONS > 0:   # this query head's positions of the keys, and their gradient sums
            pos_j = _as_rows(_tensor_positions(PosK, off_bh.to(tl.int64) * keys_all + k_start, offs_n,
                                               key_ok))
        if POS_GRADS:
            dpos_k = _zero_tiles(BLOCK_N, BLOCK_M)
        # this head's table, at d_top - (query position - key position): the tokens', or with
        # TABLE_POSITIONS the integer positions of the tensors
        # d_top_b - 33554433 is d_top, unknowable to the compiler (TABLE_ROW_ARGS)
        if TABLE_POSITIONS:
            key_at = pos_j.to(tl.int32)
        else:
            key_at = offs_n_abs[:, None]
        tab_cols = Table + off_h.to(tl.int64) * tab_stride_h + (d_top_b - 33554433 + key_at)
        m_start = m_lo
        m_end = Nq
        if SKIP:
            # block skipping: the query tiles whose distances to this key tile meet the window
            lo = tl.load(Window + off_h * 2)
            hi = tl.load(Window + off_h * 2 + 1)
            col0 = pid_n * BLOCK_N + k_offset - q_offset
            m_end = tl.minimum(Nq, tl.maximum(col0 + BLOCK_N + hi, 0))
            m_start = tl.maximum(m_lo, tl.minimum(tl.maximum(col0 + lo, 0), m_end) // BLOCK_M * BLOCK_M)
        # SPLIT_STEADY: the query tiles [m_mid_lo, m_mid_hi) hold rows that all exist and see
        # every key of this tile (between the diagonal and the ragged end): the where() that
        # masks P selects every score there, so a branch on the tile skips it (the same bits).
        # One loop with a branch, not three loops: ptxas gave three 255 registers a thread (two
        # CTAs an SM), one 160 (docs/performance.md, "The dK/dV kernel's steady tiles").
        m_mid_lo = m_start
        m_mid_hi = m_start
        if SPLIT_STEADY:
            m_mid_lo, m_mid_hi = _steady_query_tiles(pid_n * BLOCK_N, Nq, Nk, q_offset, k_offset,
                                                     m_start, m_end, CAUSAL, BLOCK_M, BLOCK_N)
        for start_m in range(m_start, m_end, BLOCK_M):
            if SPLIT_STEADY:   # (a uniform branch below; unsplit, a constexpr)
                masked = (start_m < m_mid_lo) | (start_m >= m_mid_hi)
            else:
                masked = True
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Nq
            qd_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=qd_mask, other=0.0)
            # the rows' m, 1/l and delta as _bwd_row_stats makes them (a row that a NaN reached
            # included): made once per row by _bwd_preprocess, or here (ROWS_READY, above)
            if ROWS_READY:
                m_row = tl.load(RowM + row_base + offs_m, mask=row_ok, other=0.0)
                inv_l = tl.load(RowL + row_base + offs_m, mask=row_ok, other=0.0)
                delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
            else:
                m_row, inv_l = _softmax_stats(RowM, RowL, row_base + offs_m, row_ok)
                delta = tl.load(Delta + row_base + offs_m, mask=row_ok, other=0.0)
                m_row, inv_l, delta = _bwd_row_stats(m_row, inv_l, delta)
            offs_m_abs = offs_m + q_offset
            # Transposed tiles [BLOCK_N, BLOCK_M]: keys along rows, queries along columns.
            qkT = _dot(k, tl.trans(q), None, DOT_PREC, UPCAST_DOT)
            if POSITIONS > 0:
                pos_i = _as_cols(_tensor_positions(PosQ, row_base, offs_m, row_ok))
                pos_d = _position_diff(pos_i, pos_j)
            else:
                pos_i = _position(offs_m_abs)[None, :]
                pos_d = _distance(offs_m_abs[None, :], offs_n_abs[:, None])
            if TABLE_POSITIONS:
                tab_at = tab_cols - pos_i.to(tl.int32)
            else:
                tab_at = tab_cols - offs_m_abs[None, :]
            visible = key_ok[:, None] & row_ok[None, :]
            n_rows = tl.load(NRow + off_b.to(tl.int64) * stride_nb + q_start + offs_m, mask=row_ok, other=0.0)
            pos_n = n_rows[None, :]
            if CAUSAL:
                visible = visible & (offs_n_abs[:, None] <= offs_m_abs[None, :])
            if RAMP:
                if CAUSAL:   # scores and statistics from each row's reference (see the forward)
                    row_ref = _ramp_reference(offs_m_abs, Nk - 1 + k_offset, k_offset, ramp_slope)
                    # (one FMA over the exact distance, bit for bit the forward's z)
                    ramp_d = (row_ref[None, :] - offs_n_abs[:, None]).to(tl.float32)
                    zT = tl.fma(ramp_d, ramp_slope, qkT * qk_scale)
                    m_row -= _ramp_row_term(offs_m_abs, row_ref, ramp_slope, ramp[1], row_abs)
                elif RAMP_SYMMETRIC:
                    # from each row's nearest key (_ramp_logit2), as the forward's statistics are
                    near = _ramp_nearest_key(offs_m_abs, Nk - 1 + k_offset, k_offset)
                    zT = _ramp_logit2(qkT, qk_scale, ramp_slope, offs_m_abs[None, :],
                                      offs_n_abs[:, None], near[None, :])
                    m_row -= _ramp_nearest_row_term(offs_m_abs, near, ramp_slope, ramp[1], row_abs)
                else:
                    zT = _logit2(qkT, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n,
                                 tab_at, sc)
            elif SCORE_IS_S and TABLE:
                zT = _table_logit2(qkT, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n,
                                   _table_load(tab_at), sc)
            elif SCORE_IS_S:
                zT = _logit2(qkT, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n,
                             tab_at, sc)
            else:
                if TABLE:   # (derivative tables are not read here)
                    tab = _value_entries(_table_load(tab_at))
                else:
                    tab = ()
                if ROW_FACTORS:
                    if ROW_CACHE:
                        # the rows' factors, from _bwd_preprocess (bit for bit the forward's)
                        logit_r2 = tl.load(RowF + (row_base + offs_m) * 2, mask=row_ok, other=0.0)[None, :]
                    else:
                        logit_r2 = _logit_row2(_position(offs_m_abs), n_rows, sc)[None, :]
                    zT = _factored_logit2(qkT, sm_scale, logit_r2, pos_d, pos_i, pos_j, pos_n, tab, sc)[0]
                else:
                    # (the parameter derivatives are unused here; the compiler drops them)
                    grads = _logit_grads(qkT * sm_scale, pos_d, pos_i, pos_j, pos_n, tab, sc)
                    dlogit_ds = grads[1]
                    zT = grads[0] * 1.4426950408889634  # log2(e)
            if not RAMP and not DS_ON_P:
                # (dS selected on the mask) a score its prior hides, z = -inf, counts as masked
                visible = visible & (zT != -float("inf"))
            if SCALED_SCORE:
                # one FFMA (helpers.py, "P of a scaled score")
                pT = tl.exp2(tl.fma(qkT, qk_scale, -m_row[None, :])) * inv_l[None, :]
            else:
                pT = tl.exp2(zT - m_row[None, :]) * inv_l[None, :]
            if masked:
                pT = tl.where(visible, pT, 0.0)
            dv = _dot(_lowp(pT, do.dtype), do, dv, DOT_PREC, UPCAST_DOT)
            dpT = _dot(v, tl.trans(do), None, DOT_PREC, UPCAST_DOT)
            # dS only where P is not 0: a masked score, one its prior hides (z = -inf) and one
            # whose P is 0 have dS = 0 even where dP is infinite (an infinite value in the key's
            # v: P (dP - delta) would be 0 * inf) or delta is NaN, as autograd through a mask
            # gives. Selecting on P, which the score needs anyway, keeps no mask alive across
            # the dP product: the mask held there cost NoPE's loop at head dim 64 on sm_90 a
            # fifth of its issue slots in predicate spills. A ramp (ALiBi, FoX) selects on the
            # mask: its logit is finite, so only a masked score has P = 0 but for underflow, and
            # selecting on P put 8-16 bytes of ALiBi's or FoX's kernel on sm_80 on the stack; so
            # do the positional kernels (not ROWS_READY), where a score its prior hides counts as
            # masked (the compare above).
            if ROW_FACTORS:
                # d logit / d s is the row's alone (ROW_FACTORS): dS = P (dP - delta) * ds_row is
                # P * fma(dP, ds_row, -delta * ds_row), the row's two factors made once per tile
                if ROW_CACHE:
                    ds_row = tl.load(RowF + (row_base + offs_m) * 2 + 1, mask=row_ok, other=0.0)
                else:
                    ds_row = _row_factors(_position(offs_m_abs), n_rows, sc)[0]
                dp_term = tl.fma(dpT, ds_row[None, :], -(delta * ds_row)[None, :])
            else:
                dp_term = dpT - delta[None, :]
            if DS_ON_P:
                dsT = tl.where(pT != 0.0, pT * dp_term, 0.0)
            else:
                dsT = tl.where(visible, pT * dp_term, 0.0)
            if POS_GRADS:   # column sums of dS * d logit / d j_c (dS: d loss / d logit)
                pos_grads = prior_position_grads(qkT * sm_scale, pos_d, pos_i, pos_j, pos_n, sc)
                dpos_k = _position_terms(dpos_k, dsT, pT, pos_grads, POSITIONS)
            if not SCORE_IS_S and not ROW_FACTORS:
                # where(): d logit / d s may be infinite where P is 0 (SSMax's log(n) of a row
                # that sees no key), and 0 * inf would be NaN
                dsT = tl.where(pT > 0.0, dsT * dlogit_ds, 0.0)
            dk = _dot(_lowp(dsT, q.dtype), q, dk, DOT_PREC, UPCAST_DOT)
        if POS_GRADS:
            _store_positions(DPosK, off_bh.to(tl.int64) * keys_all + k_start, offs_n, key_ok,
                             _position_reduce(dpos_k, 1))
    dk = dk * sm_scale
    if HAS_KEY_MASK:
        # A padding key: no query sees it, so its dK and dV are 0. The loop above treats it as
        # a key (its P and dS are wrong), but a key's scores only reach its own dK and dV
        # rows (delta, m and l come from the forward, which hid it): zeroing them here is
        # exact, keeps the main loop the plain one, and drops a NaN stored in the key. Its
        # position sums are zeroed by the launcher (launch.backward_kernels).
        kept = _kept_keys(KeyMask + off_b.to(tl.int64) * stride_mb + k_start, offs_n, Nk)
        dk = tl.where(kept[:, None], dk, 0.0)
        dv = tl.where(kept[:, None], dv, 0.0)
    key_rows = off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh + k_start.to(tl.int64) * stride_dkn
    tl.store(DK + key_rows + offs_n[:, None] * stride_dkn + offs_d[None, :], _lowp(dk, DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + key_rows + offs_n[:, None] * stride_dkn + offs_d[None, :], _lowp(dv, DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _grad_sums(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_GRADS: tl.constexpr,
               TILE_GRAD_SUMS: tl.constexpr, DS_ROWS_KNOWN: tl.constexpr):
    """The dQ kernel's per-parameter accumulators, zero: (sum dS g, sum P g) for each learnable
    parameter in turn, [BLOCK_M] where they are reduced per key tile (TILE_GRAD_SUMS, and
    TILE_ROW_SUMS for sum P g), else [BLOCK_M, BLOCK_N]; with DS_ROWS_KNOWN the first alone,
    sum (dS - rowsum(dS) P) g."""
    sums = ()
    for _ in tl.static_range(NUM_GRADS):
        if TILE_GRAD_SUMS:
            sums = sums + (tl.zeros([BLOCK_M], dtype=tl.float32),)
        else:
            sums = sums + (tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),)
        if not DS_ROWS_KNOWN:
            if TILE_ROW_SUMS:
                sums = sums + (tl.zeros([BLOCK_M], dtype=tl.float32),)
            else:
                sums = sums + (tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),)
    return sums


@triton.jit(do_not_specialize=TABLE_ROW_ARGS)
def _attn_bwd_dq(Q, K, V, Theta, DO, Mrow, Lrow, Delta, DQ, DTheta, RowSums, Table, Window, NRow,
                 KeyMask, QOff, KOff, CuSeqQ, CuSeqK, Work, PosQ, PosK, DPosQ,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                 Hq, GROUP, Nq, Nk, q_offset, k_offset, sm_scale, d_top_b, tab_slot, tab_stride_h, stride_nb,
                 stride_mb, row_abs,
                 NUM_PARAMS: tl.constexpr, NUM_GRADS: tl.constexpr, GRAD_BASE: tl.constexpr,
                 GRAD_COUNT: tl.constexpr, DIST_SUMS: tl.constexpr, DIST_K: tl.constexpr,
                 CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 ROW_SUMS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, ROW_OFFSETS: tl.constexpr,
                 VARLEN: tl.constexpr, SPLIT_STEADY: tl.constexpr):
    """One program: one query tile of one (batch, head). Writes dQ and, for each learnable
    parameter, one partial sum of dS * d logit / d param into DTheta[program, head, param]
    (the host sums the programs: deterministic, no atomics, no N^2 tensor).
    ROW_SUMS (backward_block): the keys are one block of the row's, so the correction below
    cannot be applied here; the partial sums leave it out and RowSums[b, h, row] receives
    the row's sum of dS and of P * d logit / d param over this block, for the caller to
    apply it once over all blocks. Otherwise, with several groups of learnable scalars,
    RowSums[b, h, row] carries each row's sum of dS from the first group's launch to the
    others' (DS_ROWS_STORE, DS_ROWS_KNOWN)."""
    sm_scale, row_abs = _fp32_scalars(sm_scale, row_abs)   # (fp64 under inductor)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_hk = off_h // GROUP
    rows_all = Nq   # the row stride of the statistics: every row of the call
    keys_all = Nk
    # The parameters' sums dS * g reduced per key tile (into [BLOCK_M]) where a tile's
    # [BLOCK_M, BLOCK_N] accumulators would take 16 registers a thread or more (64x32 with
    # 4 warps: it frees them for that tile on sm_90), else accumulated per score (sm_80's
    # 32x32: its row reductions go through shared memory and turn the loop LSU-bound).
    # (ROW_FACTORS only: the other priors accumulate per score.)
    TILE_GRAD_SUMS: tl.constexpr = ROW_FACTORS and BLOCK_M * BLOCK_N >= 2048
    WRITE_DQ: tl.constexpr = GRAD_BASE == 0   # (one group's launch writes dQ: see GRAD_BASE)
    # A prior with several groups of learnable scalars: the first group's launch writes each
    # row's sum of dS to RowSums (indexed as Delta), and the later ones read it before their
    # loop, so that the correction below enters each score's weight, dS - rowsum(dS) P, and a
    # parameter takes one accumulator instead of two, and one FFMA a score (FIRE's later
    # launches: 15% fewer instructions, 8 bytes of stack where 16). Not with packed documents
    # or position tensors, whose later launches compiled with more stack that way, not less
    # (docs/performance.md, "FIRE's later groups")
    ROWS_SHARED: tl.constexpr = not ROW_SUMS and not VARLEN and POSITIONS == 0
    DS_ROWS_KNOWN: tl.constexpr = ROWS_SHARED and GRAD_BASE > 0 and GRAD_COUNT > 0
    DS_ROWS_STORE: tl.constexpr = (ROWS_SHARED and GRAD_BASE == 0 and 0 < GRAD_COUNT
                                   and GRAD_COUNT < NUM_GRADS)
    SUMS_EACH: tl.constexpr = 1 if DS_ROWS_KNOWN else 2   # accumulators a parameter (sums)
    INTERLEAVED: tl.constexpr = TABLE_WIDTH > 0 and not DIST_SUMS   # (DIST_SUMS: the plain table)
    POS_GRADS: tl.constexpr = POSITIONS > 0 and not TABLE_POSITIONS and POSITION_GRADS
    # this program's query tile, and the rows and keys it lives in (a document's, VARLEN)
    pid_m, q_start, Nq, k_start, Nk = _program_span(Work, CuSeqQ, CuSeqK, tl.program_id(0), Nq,
                                                    Nk, VARLEN)
    q_offset, k_offset = _row_offsets(QOff, KOff, off_b, q_offset, k_offset, ROW_OFFSETS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Nq
    d_ok = offs_d < D
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q_head = off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qm
    q = tl.load(Q + q_head + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + q_start.to(tl.int64) * stride_dom + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=qd_mask, other=0.0)
    stats_rows = pid_bh.to(tl.int64) * rows_all + q_start   # this head's rows in Mrow, Lrow, Delta
    m_row, inv_l = _softmax_stats(Mrow, Lrow, stats_rows + offs_m, row_ok)
    delta = tl.load(Delta + stats_rows + offs_m, mask=row_ok, other=0.0)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    km_base = KeyMask + off_b.to(tl.int64) * stride_mb + k_start
    sc = prior_scalars(Theta + off_h * NUM_PARAMS)
    offs_m_abs = offs_m + q_offset
    if POSITIONS > 0:
        pos_i = _as_rows(_tensor_positions(PosQ, stats_rows, offs_m, row_ok))
    else:
        pos_i = _position(offs_m_abs)[:, None]
    # the rows' table entries start at d_top - (the query's position): its token's, or with
    # TABLE_POSITIONS its integer position from the tensor
    if TABLE_POSITIONS:
        row_at = pos_i.to(tl.int32)
    else:
        row_at = offs_m_abs[:, None]
    # d_top_b - 33554433 is d_top, unknowable to the compiler (TABLE_ROW_ARGS)
    if INTERLEAVED:
        # the interleaved table: TABLE_WIDTH floats per distance (the log-prior, then its derivatives)
        tab_rows = Table + off_h.to(tl.int64) * tab_stride_h + (d_top_b - 33554433 - row_at) * TABLE_WIDTH
    else:
        tab_rows = Table + off_h.to(tl.int64) * tab_stride_h + (d_top_b - 33554433 - row_at)
    if RAMP:
        ramp = prior_ramp(sc)
        ramp_slope = ramp[0]
        if CAUSAL:   # scores and statistics from each row's reference (see the forward)
            row_ref = _ramp_reference(offs_m_abs, Nk - 1 + k_offset, k_offset, ramp_slope)
            m_row -= _ramp_row_term(offs_m_abs, row_ref, ramp_slope, ramp[1], row_abs)
            row_ref_f = row_ref.to(tl.float32)
        elif RAMP_SYMMETRIC:   # from each row's nearest key (_ramp_logit2), as the forward's statistics are
            near = _ramp_nearest_key(offs_m_abs, Nk - 1 + k_offset, k_offset)
            m_row -= _ramp_nearest_row_term(offs_m_abs, near, ramp_slope, ramp[1], row_abs)
        # d logit / d p on the causal side is a per-head constant times ramp_d: the sums take
        # ramp_d (exact, finite) and the constant multiplies them once, after the loop
        ramp_factors = ()
        for g in tl.static_range(GRAD_COUNT):
            if (RAMP_SYMMETRIC or CAUSAL) and not ROW_SUMS:
                ramp_factors = ramp_factors + (ramp[2 + GRAD_BASE + g],)
            else:
                ramp_factors = ramp_factors + (1.0,)
    n_hi = Nk
    n_rows = tl.load(NRow + off_b.to(tl.int64) * stride_nb + q_start + offs_m, mask=row_ok, other=0.0)
    pos_n = n_rows[:, None]
    if ROW_FACTORS:
        # the derivatives' row factors: the loop sums their per-score parts
        logit_r2 = _logit_row2(_position(offs_m_abs), n_rows, sc)[:, None]
        row_factors = _row_factors(_position(offs_m_abs), n_rows, sc)
        ds_row = row_factors[0]
    if CENTER_GRADS:
        # each derivative at the row's own position (d = 0, j = i): a per-row constant that the
        # sums subtract (sum_j dS_ij (g_ij - c_i) - (sum_j dS_ij)(sum_j P_ij (g_ij - c_i)) is the
        # same gradient: sum_j P_ij = 1), 0 where it is not finite
        at_row = prior_grads(0.0, _own_distance(pos_i), pos_i, pos_i, pos_n, (), sc)
        centres = ()
        for g in tl.static_range(GRAD_COUNT):
            centre = at_row[GRAD_BASE + g] + tl.zeros([BLOCK_M, 1], dtype=tl.float32)
            centres = centres + (tl.where(tl.abs(centre) < float("inf"), centre, 0.0),)
    if CAUSAL:
        n_hi = tl.minimum(Nk, tl.maximum(pid_m * BLOCK_M + BLOCK_M + q_offset - k_offset, 0))
    qk_scale = sm_scale * 1.4426950408889634  # log2(e)
    n_lo = 0
    if SKIP:
        n_lo, n_hi = _window_keys(Window, off_h, pid_m * BLOCK_M + q_offset - k_offset, BLOCK_M,
                                  n_hi, BLOCK_N)
    if SPLIT_STEADY:
        n_full = _steady_keys(pid_m * BLOCK_M, Nq, Nk, q_offset, k_offset, n_lo, n_hi, CAUSAL,
                              SKIP, BLOCK_M, BLOCK_N, WHOLE_ROWS=True)
    else:
        n_full = n_lo
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Parameter gradients, row by row: sum_j dS_ij g_ij - (sum_j dS_ij)(sum_j P_ij g_ij).
    # The second term is 0 in exact arithmetic (a softmax's dS sums to 0 over its row); with
    # Delta = rowsum(dO * O) from the P that was rounded for the P @ V product it is not, and
    # for a derivative g that grows with |d| (ALiBi's |d|/b^2) the leftover, times g, would
    # swamp the gradient. Subtracting it removes that error to first order.
    # sum_j dS_ij g_ij accumulates elementwise in [BLOCK_M, BLOCK_N] registers (one FFMA per
    # score), reduced over the row once, after the loop. The two row sums of the correction
    # do too for a prior with one learnable parameter; with more (TILE_ROW_SUMS), where
    # the registers would not hold a [BLOCK_M, 32] tile, they are reduced per key tile
    # (in-thread adds and two warp shuffles per row: the MMA layout keeps a row in one warp).
    # (sums[2 g], sums[2 g + 1]): parameter g's sum_j dS g and sum_j P g (DS_ROWS_KNOWN:
    # sums[g], parameter g's sum_j (dS - rowsum(dS) P) g: SUMS_EACH)
    if DS_ROWS_KNOWN:
        ds_rows = tl.load(RowSums + stats_rows + offs_m, mask=row_ok, other=0.0)
    elif TILE_ROW_SUMS:
        ds_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        ds_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sums = _grad_sums(BLOCK_M, BLOCK_N, GRAD_COUNT, TILE_GRAD_SUMS, DS_ROWS_KNOWN)
    if DIST_SUMS:
        # each key tile's dS skewed: row a's score at (a, b) lands in column u = b - a + BLOCK_M - 1,
        # so that a column holds one distance d = i - j (table entry e_tile + u); DIST_W columns
        # hold the tile's BLOCK_M + BLOCK_N - 1 distances
        DIST_W: tl.constexpr = 2 * max(BLOCK_M, BLOCK_N)
        dist_u = tl.arange(0, DIST_W)
        # the contraction goes DIST_CHUNK derivative columns at a time, so that the slab a
        # thread holds stays small whatever DIST_K (a 128-entry table still spills 576 bytes at
        # 32 x 32 on sm_90: docs/performance.md, "Per-distance sums")
        DIST_CHUNK: tl.constexpr = min(DIST_K, 16)
        dist_k = tl.arange(0, DIST_CHUNK)
        skew_b = dist_u[None, :] - (BLOCK_M - 1) + tl.arange(0, BLOCK_M)[:, None]
        skew_ok = (skew_b >= 0) & (skew_b < BLOCK_N)
        skew_at = tl.minimum(tl.maximum(skew_b, 0), BLOCK_N - 1)
        dist_rows = (dist_u < BLOCK_M + BLOCK_N - 1)[:, None]
        tab_grads = Table + off_h.to(tl.int64) * tab_stride_h + (1 + dist_k)[None, :] * tab_slot
        dist_acc = ()
        for c in tl.static_range(DIST_K // DIST_CHUNK):
            dist_acc = dist_acc + (tl.zeros([DIST_CHUNK], dtype=tl.float32),)
    if POS_GRADS and WRITE_DQ:
        # the rows' positions' gradients, sum_j dS g - (sum_j dS)(sum_j P g) per channel (the
        # parameters' correction: a FoX row's derivative is 1, and sum_j dS = 0)
        dpos_q = _zero_tiles(BLOCK_M, BLOCK_N)
        pos_means = _zero_tiles(BLOCK_M, BLOCK_N)
        pos_ds = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Two runs of key tiles, as in the forward (SPLIT_STEADY; else the second alone): [n_lo,
    # n_full) is seen whole by every row of a whole query tile (the steady state: no causal or
    # bounds mask, K and V read unmasked; a key_mask still hides its padding keys), then
    # [n_full, n_hi), the diagonal and the ragged end. The where()s the steady run leaves out
    # select every score there, so both runs compute the same bits.
    for run in tl.static_range(0 if SPLIT_STEADY else 1, 2):
        STEADY = run == 0   # (a constexpr: static_range unrolls the runs)
        MASKED = HAS_KEY_MASK or not STEADY
        if STEADY:
            tiles_lo = n_lo
            tiles_hi = n_full
        else:
            tiles_lo = n_full
            tiles_hi = n_hi
        for start_n in range(tiles_lo, tiles_hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < Nk
            if HAS_KEY_MASK:   # padding keys: hidden, and read as 0 (a NaN there reaches nothing)
                key_ok = _kept_keys(km_base, offs_n, Nk)
            if STEADY and not HAS_KEY_MASK:
                k = _load_kv(k_base, offs_n, stride_kn, offs_d, Nk, False, D, HEAD_DIM)
                v = _load_kv(v_base, offs_n, stride_vn, offs_d, Nk, False, D, HEAD_DIM)
            else:
                kv_mask = key_ok[:, None] & d_ok[None, :]
                k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask,
                            other=0.0)
                v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask,
                            other=0.0)
            qk = _dot(q, tl.trans(k), None, DOT_PREC, UPCAST_DOT)
            offs_n_abs = offs_n + k_offset
            if POSITIONS > 0:
                pos_j = _as_cols(_tensor_positions(PosK, pid_bh.to(tl.int64) * keys_all + k_start, offs_n,
                                                   offs_n < Nk))
                pos_d = _position_diff(pos_i, pos_j)
            else:
                pos_j = _position(offs_n_abs)[None, :]
                pos_d = _distance(offs_m_abs[:, None], offs_n_abs[None, :])
            if STEADY:   # the padding keys alone (read where MASKED: with HAS_KEY_MASK)
                visible = tl.broadcast_to(key_ok[None, :], (BLOCK_M, BLOCK_N))
            else:
                visible = row_ok[:, None] & key_ok[None, :]
                if CAUSAL:
                    visible = visible & (offs_n_abs[None, :] <= offs_m_abs[:, None])
            if TABLE_POSITIONS:
                key_at = pos_j.to(tl.int32)
            else:
                key_at = offs_n_abs[None, :]
            if INTERLEAVED:
                # the tile's log-prior and derivative entries, four per vector load
                tab_at = tab_rows + key_at * TABLE_WIDTH
                tab = ()
                for group in tl.static_range(TABLE_WIDTH // 4):
                    tab = tab + _table_load4(tab_at + 4 * group)
            else:
                tab_at = tab_rows + key_at
            if RAMP:
                if CAUSAL:
                    ramp_d = row_ref_f[:, None] - pos_j   # exact: positions stay within 2**24 (MAX_POSITION)
                    z = tl.fma(ramp_d, ramp_slope, qk * qk_scale)
                elif RAMP_SYMMETRIC:
                    z = _ramp_logit2(qk, qk_scale, ramp_slope, offs_m_abs[:, None], offs_n_abs[None, :],
                                     near[:, None])
                    # |d| - |d_ref|, exact (the derivative of an even ramp is a constant times |d|)
                    ramp_d = (tl.abs(offs_m_abs[:, None] - offs_n_abs[None, :])
                              - tl.abs(offs_m_abs - near)[:, None]).to(tl.float32)
                else:
                    z = _logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_at, sc)
                if GRAD_COUNT > 0:
                    if (RAMP_SYMMETRIC or CAUSAL) and not ROW_SUMS:
                        # from the row's reference too: the derivative's part that is constant along
                        # the row (ALiBi's |d_ref| / b^2, which grows with the positions) meets
                        # sum_j dS = 0 (each times its ramp factor, after the loop)
                        dlogit = ()
                        for g in tl.static_range(NUM_GRADS):
                            dlogit = dlogit + (ramp_d,)
                    else:
                        dlogit = prior_grads(0.0, pos_d, pos_i, pos_j, pos_n, (), sc)   # (clamped below)
            elif SCORE_IS_S:
                if INTERLEAVED:
                    z = _table_logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab[0], sc)
                else:
                    z = _logit2(qk, qk_scale, sm_scale, pos_d, pos_i, pos_j, pos_n, tab_at, sc)
                    tab = ()
                if GRAD_COUNT > 0:
                    dlogit = prior_grads(0.0, pos_d, pos_i, pos_j, pos_n, tab, sc)
            else:
                if TABLE and not INTERLEAVED:
                    tab = (_table_load(tab_at),)
                elif not TABLE:
                    tab = ()
                if ROW_FACTORS:
                    z, logit_u = _factored_logit2(qk, sm_scale, logit_r2, pos_d, pos_i, pos_j, pos_n, tab, sc)
                    if GRAD_COUNT > 0:
                        # each parameter's per-score factor (times its row factor, after the loop); a
                        # parameter whose factor is the logit's own u takes u (GRAD_LOGIT_FACTOR)
                        dlogit = prior_score_factors(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, tab, sc)
                else:
                    out = _logit_grads(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, tab, sc)
                    dlogit_ds = out[1]
                    dlogit = out[2:]
                    z = out[0] * 1.4426950408889634  # log2(e)
            if SCALED_SCORE:
                # one FFMA (helpers.py, "P of a scaled score")
                p = tl.exp2(tl.fma(qk, qk_scale, -m_row[:, None])) * inv_l[:, None]
            else:
                p = tl.exp2(z - m_row[:, None]) * inv_l[:, None]
            if MASKED:
                p = tl.where(visible, p, 0.0)
            dp = _dot(do, tl.trans(v), None, DOT_PREC, UPCAST_DOT)
            # where(): a masked score has dS = 0 even in a row whose delta is NaN (a NaN in its dO,
            # or in a seen key's v), as autograd through a mask gives. (Selecting on P != 0, as the
            # dK/dV kernel does, cost this loop more issue slots than it saved.)
            ds = p * (dp - delta[:, None])
            if MASKED:
                ds = tl.where(visible, ds, 0.0)
            if POS_GRADS and WRITE_DQ:
                pos_grads = prior_position_grads(qk * sm_scale, pos_d, pos_i, pos_j, pos_n, sc)
                dpos_q = _position_terms(dpos_q, ds, p, pos_grads, 0)
                pos_means = _position_terms(pos_means, p, p, pos_grads, 0)
                pos_ds += ds
            if DS_ROWS_KNOWN:
                # each score's weight with the row's correction in it (one FFMA)
                ds_w = tl.fma(-ds_rows[:, None], p, ds)
            else:
                ds_w = ds
            if GRAD_COUNT > 0 and not DS_ROWS_KNOWN:
                if TILE_ROW_SUMS:
                    ds_rows += tl.sum(ds, 1)
                else:
                    ds_acc += ds
            if DIST_SUMS:
                # dS summed per distance (the skewed tile's columns), times each derivative's
                # table entries at those distances: sum_ij dS_ij g(i - j) = sum_d g(d) sum_{i-j=d} dS_ij
                per_dist = tl.sum(tl.where(skew_ok, tl.gather(ds, skew_at, 1), 0.0), 0)
                e_tile = (d_top_b - 33554433 - (pid_m * BLOCK_M + q_offset) + (start_n + k_offset)
                          - (BLOCK_M - 1))
                entry = e_tile + dist_u
                in_table = dist_rows & ((entry >= 0) & (entry < tab_slot))[:, None]
                new_acc = ()
                for c in tl.static_range(DIST_K // DIST_CHUNK):
                    column = c * DIST_CHUNK + dist_k
                    slab = tl.load(tab_grads + c * DIST_CHUNK * tab_slot + entry[:, None],
                                   mask=in_table & (column < NUM_GRADS)[None, :], other=0.0)
                    new_acc = new_acc + (dist_acc[c] + tl.sum(per_dist[:, None] * slab, 0),)
                dist_acc = new_acc
            new_sums = ()
            for g in tl.static_range(GRAD_COUNT):
                # (GRAD_BASE + g: its index among all the learnable scalars, a constexpr)
                if RAMP:
                    seen = dlogit[GRAD_BASE + g]
                    if not CAUSAL or ROW_SUMS:
                        seen = tl.where(p > 0.0, _clamped(seen), 0.0)
                elif GRAD_MODES[GRAD_BASE + g] == GRAD_TABLE:
                    seen = dlogit[GRAD_BASE + g]  # a table entry: clamped, 0 where P is
                elif GRAD_MODES[GRAD_BASE + g] == GRAD_LOGIT_FACTOR:
                    # the logit's own per-score factor: finite wherever P > 0
                    seen = tl.where(p > 0.0, logit_u, 0.0)
                elif CENTER_GRADS:
                    seen = tl.where(p > 0.0, _clamped(dlogit[GRAD_BASE + g] - centres[g]), 0.0)
                else:
                    seen = tl.where(p > 0.0, _clamped(dlogit[GRAD_BASE + g]), 0.0)
                if TILE_GRAD_SUMS:
                    new_sums = new_sums + (sums[SUMS_EACH * g] + _row_dot(ds_w, seen),)
                else:
                    # tl.fma: one FFMA each (the kernels compile with contraction off, see FP_FUSION)
                    new_sums = new_sums + (tl.fma(ds_w, seen, sums[SUMS_EACH * g]),)
                if not DS_ROWS_KNOWN:
                    if TILE_ROW_SUMS:
                        new_sums = new_sums + (sums[2 * g + 1] + _row_dot(p, seen),)
                    else:
                        new_sums = new_sums + (tl.fma(p, seen, sums[2 * g + 1]),)
            sums = new_sums
            if WRITE_DQ:
                if not SCORE_IS_S and not ROW_FACTORS:
                    ds = tl.where(p > 0.0, ds * dlogit_ds, 0.0)   # (see the dK/dV kernel)
                dq = _dot(_lowp(ds, k.dtype), k, dq, DOT_PREC, UPCAST_DOT)
    if WRITE_DQ:
        if ROW_FACTORS:
            dq = dq * (sm_scale * ds_row)[:, None]   # d logit / d s, the row's alone
        else:
            dq = dq * sm_scale
        # A row that sees no key (l = 0) has dQ = 0: its dS is P (dP - delta) with P = 0, but a
        # hidden key whose V holds inf makes dP infinite there, and 0 * inf is NaN
        dq = tl.where((inv_l == 0.0)[:, None], 0.0, dq)
        tl.store(DQ + q_head + offs_m[:, None] * stride_qm + offs_d[None, :],
                 _lowp(dq, DQ.dtype.element_ty), mask=qd_mask)
        if POS_GRADS:
            dpos_q = _position_reduce(dpos_q, 1)
            pos_means = _position_reduce(pos_means, 1)
            pos_ds = tl.sum(pos_ds, 1)
            corrected = ()
            for c in tl.static_range(POSITIONS):
                if ROW_SUMS:   # one block of the row's keys: the raw sums, which add up
                    corrected = corrected + (dpos_q[c],)
                else:
                    corrected = corrected + (dpos_q[c] - pos_ds * pos_means[c],)
            _store_positions(DPosQ, stats_rows, offs_m, row_ok, corrected)
    # one partial sum per program (tl.program_id(0): the tile, or with VARLEN the work item)
    partial = (DTheta + ((off_b * tl.num_programs(0) + tl.program_id(0)) * Hq + off_h) * NUM_GRADS
               + GRAD_BASE)
    if DIST_SUMS:
        for c in tl.static_range(DIST_K // DIST_CHUNK):
            column = c * DIST_CHUNK + dist_k
            tl.store(partial + column, dist_acc[c], mask=column < NUM_GRADS)
    grads = ()
    means = ()
    for g in tl.static_range(GRAD_COUNT):
        grads = grads + (sums[SUMS_EACH * g],)
        if not DS_ROWS_KNOWN:
            means = means + (sums[2 * g + 1],)
    if GRAD_COUNT > 0:
        if not TILE_ROW_SUMS and not DS_ROWS_KNOWN:
            ds_rows = tl.sum(ds_acc, 1)
            summed = ()
            for g in tl.static_range(GRAD_COUNT):
                summed = summed + (tl.sum(means[g], 1),)
            means = summed
        if not TILE_GRAD_SUMS:
            summed = ()
            for g in tl.static_range(GRAD_COUNT):
                summed = summed + (tl.sum(grads[g], 1),)
            grads = summed
        # (ROW_FACTORS: each row's sums times its row factors, clamped as the per-score
        # derivatives would be (_clamped): the factor multiplies the corrected row sum, not its
        # two terms apart, whose products may overflow where their difference does not.)
        # A row that sees no key (l = 0) gives its parameters nothing, as it gives dQ nothing
        # (above): its P is 0, but a hidden key whose V holds inf or NaN makes its dS 0 * inf,
        # and its sums NaN. Zeroed per row here, after the loop, not per score inside it
        # (docs/reliability.md, "A dead row's parameter sums")
        dead = inv_l == 0.0
        ds_rows = tl.where(dead, 0.0, ds_rows)
        alive = ()
        for g in tl.static_range(GRAD_COUNT):
            alive = alive + (tl.where(dead, 0.0, grads[g]),)
        grads = alive
        if not DS_ROWS_KNOWN:
            alive = ()
            for g in tl.static_range(GRAD_COUNT):
                alive = alive + (tl.where(dead, 0.0, means[g]),)
            means = alive
        row_at = RowSums + (stats_rows + offs_m) * (1 + NUM_GRADS) + GRAD_BASE
        if ROW_SUMS and WRITE_DQ:
            tl.store(row_at, ds_rows, mask=row_ok)
        if DS_ROWS_STORE:   # (for the later groups' launches: DS_ROWS_KNOWN)
            tl.store(RowSums + stats_rows + offs_m, ds_rows, mask=row_ok)
    for g in tl.static_range(GRAD_COUNT):
        # the row's corrected sum, sum_j dS g - (sum_j dS)(sum_j P g) (with ROW_SUMS the
        # caller corrects; with DS_ROWS_KNOWN the weights did)
        corrected = grads[g]
        if not ROW_SUMS and not DS_ROWS_KNOWN:
            corrected = grads[g] - ds_rows * means[g]
        factor = 1.0
        if ROW_FACTORS:
            factor = row_factors[1 + GRAD_BASE + g]
        if ROW_SUMS:
            if ROW_FACTORS:
                tl.store(row_at + 1 + g, _clamped_sum(factor * means[g]), mask=row_ok)
                tl.store(partial + g, tl.sum(_clamped_sum(factor * grads[g]), 0))
            else:
                tl.store(row_at + 1 + g, means[g], mask=row_ok)
                tl.store(partial + g, tl.sum(grads[g], 0))
        elif RAMP:
            # (a ramp's factor, 1/b^2 for ALiBi's b, overflows float32 for a tiny b; where its
            # sum is 0, one key at the row's reference distance, the product is 0, not inf * 0)
            ramp_sum = tl.sum(corrected, 0)
            tl.store(partial + g, tl.where(ramp_sum == 0.0, 0.0, _clamped_sum(ramp_factors[g] * ramp_sum)))
        elif ROW_FACTORS:
            tl.store(partial + g, tl.sum(_clamped_sum(factor * corrected), 0))
        else:
            tl.store(partial + g, tl.sum(corrected, 0))
