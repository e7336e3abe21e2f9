"""Where a prior enters bamgen's Triton kernels: its flags and its hooks.

The kernels (helpers.py, forward.py, backward.py, decode.py) are written once. They read the
names below as globals; variant.py instantiates them per prior with that prior's values in
their place (its flags, and the hooks its generated module printed from the formula), the way
FlashInfer instantiates its attention templates with a variant struct and inductor's flex
attention calls one `modification` hook. The defaults here are NoPE's: no prior term, no
parameters. docs/architecture.md ("Hooks") says why the kernels find these by name rather
than as tl.constexpr arguments: torch.compile's inductor re-emits a user kernel's source with
what its globals name, and writes its constexpr arguments as literals.

Flags (tl.constexpr; each prior's values come from its PriorTraits):
  SCORE_IS_S      the logit is s + log_prior: the kernels compute (q.k * scale + bias) * log2(e),
                  d logit / d s = 1 and prior_grads gives the parameter derivatives alone
  HAS_BIAS        (SCORE_IS_S, inline strategy) prior_bias gives a log-prior that is not 0
  TABLE           table strategy: the prior is gathered from a distance table built per call (by
                  the table kernels from prior_distance, table.py; or by torch,
                  bamgen/runtime/tables.py); hooks read the entries in `tab`
  TABLE_SLOTS     entries per distance in the table: the log-prior, then one per tabulated
                  parameter derivative
  TABLE_WIDTH     floats per distance of the dQ kernel's interleaved table (groups of four read
                  with one vector load each); 0: dQ reads the forward's table
  RAMP            (inline, SCORE_IS_S) the log-prior is a line in d on the causal side: a causal
                  logit is s + slope * (ref - j) (prior_ramp gives the line)
  RAMP_SYMMETRIC  the ramp is even in d (ALiBi's -|d|/b): without the causal mask too, a row's
                  scores are measured from its nearest key
  ROW_FACTORS     a score other than s + log_prior whose derivatives factor into a part constant
                  along a row and a per-score part (SSMax): the prior_row_factors,
                  prior_score_factors, prior_logit_row and prior_logit_score hooks
  ROW_CACHE       (ROW_FACTORS) the backward's preprocess kernel stores each row's two factors
                  for dK/dV (they read n and the parameters alone)
  LOGIT_FMA       (ROW_FACTORS) the logit's per-score factor is u = s + v: one FFMA
  SKIP            block skipping: key tiles outside each head's window of distances (Window,
                  from the table) are not visited
  GRAD_MODES      per learnable parameter, how dQ takes its per-score derivative: 0 printed
                  (clamped to float32's range, 0 where P is 0), 1 a table entry (clamped on the
                  host), 2 the logit's own factor u (finite wherever P > 0)
  TILE_ROW_SUMS   (two or more learnable parameters) the dQ kernel reduces its correction's
                  row sums per key tile, which frees registers for wider tiles
  CENTER_GRADS    (inline, SCORE_IS_S, reads i, j or n; over channels i_c, j_c or n) dQ takes
                  each derivative minus its value at the row's own position (d = 0 in every
                  channel, j = i): the same gradient, without the rounding of
                  a large part that is constant along the row (SCORE_IS_S's -c * |i|, say)
  CLAMP_POSITIONS (reads i or j) the hooks see a padding token's negative position as 0, and d
                  from the positions so read: a formula is only ever evaluated at real tokens'
                  positions (helpers._position, _distance); masks follow the positions as they are
  POSITIONS       0: positions are the tokens' (the offsets); C > 0: they come from the tensors
                  PosQ, PosK ([B, Hq, N, C] float32: pos_q, pos_k, docs/positions.md), C
                  channels, and the backward kernels write their gradients (DPosQ, DPosK) from
                  prior_position_grads; with C > 1 the hooks' pos_d, pos_i, pos_j are tuples of
                  C tiles (the positional plan: inline, no ramp, no row factors)
  TABLE_POSITIONS (POSITIONS = 1, TABLE) the positions are integers (held in float32) and each
                  score reads the distance table at d_top - (pos_i - pos_j) instead of at its
                  tokens' distance; the positions take no gradient (DPosQ, DPosK are not
                  written): traits.position_table_traits, docs/positions.md "Integer positions"
  ROWS_READY      (traits.rows_ready: all but POSITIONS) _bwd_preprocess writes each row's m and
                  1/l, which the dK/dV kernel reads (RowM, RowL); else the dK/dV kernel takes the
                  forward's m and l there and makes them per query tile
  POSITION_GRADS  (traits.position_grads) some derivative of the logit by a position is not 0;
                  off (NoPE), the backward kernels of POSITIONS sum no positions' gradients
                  (DPosQ, DPosK keep the zeros they were made with)
  SCALED_SCORE    (derived: SCORE_IS_S without a bias, a table or a ramp: NoPE) the logit is
                  q.k * qk_scale alone, and every kernel computes P in one FFMA against the row's
                  max (helpers.py, "P of a scaled score")

Hooks (@triton.jit functions printed by the compiler; `sc` is prior_scalars' tuple, `tab` the
tile's table entries (tab_v, then the tabulated derivatives; () without a table), positions
pos_d = i - j, pos_i, pos_j, pos_n (the visible keys) are float32 tiles):
  prior_scalars(Theta_h)          the head's parameters (Theta_h[slot]) and every value that
                                  depends on them alone, computed once per program
  prior_bias(pos_d, pos_i, pos_j, pos_n, sc)                  the log-prior (HAS_BIAS)
  prior_grads(s, pos_d, pos_i, pos_j, pos_n, tab, sc)         SCORE_IS_S: the tuple of
                                  d logit / d p for each learnable p (s unread); else (logit,
                                  d logit / d s, then those)
  prior_ramp(sc)                  (slope, intercept, then log(2) * d slope / d p per learnable
                                  p) of log2(e) * log_prior on the causal side (RAMP)
  prior_row_factors(pos_i, pos_n, sc)   (d logit / d s, then each learnable p's row factor)
  prior_score_factors(s, pos_d, pos_i, pos_j, pos_n, tab, sc)  each learnable p's per-score
                                  factor (d logit / d p over its row factor)
  prior_logit_row(pos_i, pos_n, sc)     the logit's row factor r (the logit is u * r)
  prior_logit_score(s, pos_d, pos_i, pos_j, pos_n, tab, sc)    u, or with LOGIT_FMA v (u = s + v)
  prior_position_grads(s, pos_d, pos_i, pos_j, pos_n, sc)     (POSITIONS) d logit / d i_c for
                                  each channel c, then d logit / d j_c
  prior_distance(pos_d, Theta_h)  (TABLE) the distance table's TABLE_SLOTS entries over float64
                                  distances pos_d, in float64, the head's parameters read from
                                  Theta_h: the table kernel's (table.py). A prior whose formula
                                  has no float64 Triton form has none, and its table is built by
                                  torch on the host (launch.distance_table)
"""
import triton
import triton.language as tl

SCORE_IS_S = tl.constexpr(True)
HAS_BIAS = tl.constexpr(False)
TABLE = tl.constexpr(False)
TABLE_SLOTS = tl.constexpr(1)
TABLE_WIDTH = tl.constexpr(0)
RAMP = tl.constexpr(False)
RAMP_SYMMETRIC = tl.constexpr(False)
ROW_FACTORS = tl.constexpr(False)
ROW_CACHE = tl.constexpr(False)
LOGIT_FMA = tl.constexpr(False)
SKIP = tl.constexpr(False)
GRAD_MODES = tl.constexpr(())
TILE_ROW_SUMS = tl.constexpr(False)
CENTER_GRADS = tl.constexpr(False)
CLAMP_POSITIONS = tl.constexpr(False)
POSITIONS = tl.constexpr(0)
TABLE_POSITIONS = tl.constexpr(False)
ROWS_READY = tl.constexpr(True)
POSITION_GRADS = tl.constexpr(True)
SCALED_SCORE = tl.constexpr(True)

FLAGS = ("SCORE_IS_S", "HAS_BIAS", "TABLE", "TABLE_SLOTS", "TABLE_WIDTH", "RAMP", "RAMP_SYMMETRIC",
         "ROW_FACTORS", "ROW_CACHE", "LOGIT_FMA", "SKIP", "GRAD_MODES", "TILE_ROW_SUMS", "CENTER_GRADS",
         "CLAMP_POSITIONS", "POSITIONS", "TABLE_POSITIONS", "ROWS_READY", "POSITION_GRADS",
         "SCALED_SCORE")
HOOKS = ("prior_scalars", "prior_bias", "prior_grads", "prior_ramp", "prior_row_factors",
         "prior_score_factors", "prior_logit_row", "prior_logit_score", "prior_position_grads",
         "prior_distance")


@triton.jit
def prior_scalars(Theta_h):
    """NoPE: no parameters."""
    return ()


@triton.jit
def prior_bias(pos_d, pos_i, pos_j, pos_n, sc):
    """NoPE: no log-prior term (not called: HAS_BIAS is off)."""
    return 0.0


@triton.jit
def prior_grads(s, pos_d, pos_i, pos_j, pos_n, tab, sc):
    """NoPE: no parameter derivatives."""
    return ()


@triton.jit
def prior_ramp(sc):
    """(not called: RAMP is off)"""
    return (0.0, 0.0)


@triton.jit
def prior_row_factors(pos_i, pos_n, sc):
    """(not called: ROW_FACTORS is off)"""
    return (1.0,)


@triton.jit
def prior_score_factors(s, pos_d, pos_i, pos_j, pos_n, tab, sc):
    """(not called: ROW_FACTORS is off)"""
    return ()


@triton.jit
def prior_logit_row(pos_i, pos_n, sc):
    """(not called: ROW_FACTORS is off)"""
    return 1.0


@triton.jit
def prior_logit_score(s, pos_d, pos_i, pos_j, pos_n, tab, sc):
    """(not called: ROW_FACTORS is off)"""
    return s


@triton.jit
def prior_position_grads(s, pos_d, pos_i, pos_j, pos_n, sc):
    """NoPE: the logit does not read the positions (one channel)."""
    return (0.0, 0.0)


@triton.jit
def prior_distance(pos_d, Theta_h):
    """(not called: no table)"""
    return (pos_d,)
