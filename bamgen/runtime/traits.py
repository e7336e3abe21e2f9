"""What the compiler knows about a prior, as the runtime reads it: frozen dataclasses that the
compiler prints into each generated module (``TRAITS``) and that the runtime, bamgen.distributed
and the integrations read. Facts travel here as fields; nothing downstream parses a formula.

No torch import: the compiler builds these too (docs/architecture.md, "Traits").
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# The interface between a generated module and bamgen.runtime. A module built for another ABI
# is refused at import with a message that says to rebuild it (its cache key covers this number).
RUNTIME_ABI = 1


@dataclass(frozen=True)
class ParamTraits:
    """One runtime parameter of a prior: its columns in the [Hq, P] parameter tensor theta
    (a scalar one, a vector of ``size`` elements ``size`` from ``slot`` on) and its domain
    (kind "real", "positive", "nonnegative" or "interval" with the open bounds)."""
    name: str
    slot: int
    learnable: bool
    per_head: bool
    domain: str
    lo: float | None = None
    hi: float | None = None
    grad_slot: int | None = None     # its first column among the learnable parameters' gradients
    size: int | None = None          # a vector's elements; None for a scalar
    attr: str = ""                   # where the nn.Module stores it ("" for the default:
                                     # raw_<name> when learnable, else <name>)

    @property
    def width(self) -> int:
        """Columns of theta it takes."""
        return self.size or 1

    @property
    def columns(self) -> range:
        return range(self.slot, self.slot + self.width)

    @property
    def grad_columns(self) -> range:
        return range(self.grad_slot, self.grad_slot + self.width) if self.learnable else range(0)

    @property
    def storage(self) -> str:
        """The nn.Module attribute that holds it (a learnable one unconstrained)."""
        return self.attr or (f"raw_{self.name}" if self.learnable else self.name)

    def labels(self) -> tuple[str, ...]:
        """Its scalars as formulas write them: b, or w[0] .. w[size - 1]."""
        if self.size is None:
            return (self.name,)
        return tuple(f"{self.name}[{k}]" for k in range(self.size))


# How the dQ kernel takes each learnable parameter's per-score derivative (PriorTraits.grad_modes)
GRAD_CLAMPED = 0      # a printed derivative: clamped to float32's range, 0 where P is 0
GRAD_TABLE = 1        # a table entry, clamped on the host and 0 where the prior is -inf
GRAD_LOGIT_FACTOR = 2  # the logit's own per-score factor u: finite wherever P > 0

# The helpers of bamgen/runtime/triton/helpers.py a generated module's Triton hooks may call:
# the compiler names those it prints (codegen._triton_globals), and Prior.kernels() binds them
# into the module's namespace when its kernels are first made (named here: no Triton import)
HOOK_HELPERS = ("_atan", "_element", "_index_floor", "_index_ceil", "_load_vector", "_load_vector64",
                "_pow64", "_sinh64", "_cosh64", "_tanh64")


@dataclass(frozen=True)
class PriorTraits:
    """The facts the runtime needs about one prior, written by the compiler.

    reads: the positions the logit reads (d, i, j, n). distance_only: it reads them through
    d = i - j alone. distance_table: the log-prior is a function of d alone, evaluated per
    distance by the module's distance_prior hook (NoPE has none). score_is_s: the logit is
    s + log_prior. strategy: "inline" or "table" (the GPU kernels' lowering). table_grads: the
    learnable parameters whose derivative the distance table holds (slot k + 1 holds
    table_grads[k]). window: the log-prior is -inf for some distances. skip: the block-skipping
    bound of the GPU kernels (natural units; -inf for an exact window; None: no skipping).
    skip_below: the prior file's skip_below. ramp / ramp_symmetric: the log-prior is a line in
    d on the causal side (even in d: also without the mask). row_factors / row_cache /
    logit_fma: the score's derivatives factor per row (RowFactors in the compiler), the
    backward's preprocess kernel caches them, the logit is fma(q.k, scale, v) * r.
    grad_modes: per learnable parameter, GRAD_CLAMPED, GRAD_TABLE or GRAD_LOGIT_FACTOR.
    center_grads: the dQ kernel measures each printed derivative from its value at the row's own
    position, d = 0 in every channel (an inline prior that reads i, j or n, over several
    channels i0, j1, .., or n: a part of the derivative that is constant along a row meets
    sum_j dS = 0, and in float32 its size would swamp the gradient).
    tile_kind: which tile table the kernels use (bamgen/runtime/triton/tiles.py).
    dist_sums: the dQ kernel takes the parameters' gradients from per-distance sums of dS
    against the derivative tables (a table prior of many tabulated scalars: T5's buckets).
    channels: position channels (`positions: C`): a prior over more than one reads d0, i0, j0,
    ... and takes its positions as tensors only (docs/positions.md). tensor_positions: these
    are the traits of the kernels whose positions come from tensors (pos_q, pos_k): inline,
    with the position derivatives among the hooks. table_positions: these are the traits of the
    kernels that read the prior's distance table at integer position tensors
    (position_table_traits). position_grads: some derivative of the logit by a position is not
    0 (NoPE's and T5's are all 0: their kernels of positions as tensors and the torch path's
    backward sum none, and the positions' gradients are 0). causal_only: the prior file
    declares causal_only: true, its formulas were checked only where a key is at or before its
    query, so every call must be causal and take token positions (runtime/checks.py,
    check_causal)."""
    name: str
    class_name: str
    params: tuple[ParamTraits, ...]
    reads: tuple[str, ...]
    distance_only: bool
    distance_table: bool
    score_is_s: bool
    strategy: str
    table_grads: tuple[str, ...] = ()
    window: bool = False
    skip: float | None = None
    skip_below: float | None = None
    has_bias: bool = False
    ramp: bool = False
    ramp_symmetric: bool = False
    row_factors: bool = False
    row_cache: bool = False
    logit_fma: bool = False
    grad_modes: tuple[int, ...] = ()
    center_grads: bool = False
    tile_kind: str = "light"
    dist_sums: bool = False
    channels: int = 1
    tensor_positions: bool = False
    table_positions: bool = False
    position_grads: bool = True
    causal_only: bool = False

    @property
    def rows_ready(self) -> bool:
        """The dK/dV kernel reads each row's m and 1/l as the backward's preprocess kernel made
        them and selects dS on P (ROWS_READY); the kernels of positions as tensors make them
        per query tile from the forward's m and l, where the leaner loop spilled
        (docs/performance.md, "The dK/dV loop's row statistics")."""
        return not self.tensor_positions

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def learnable(self) -> tuple[str, ...]:
        """The learnable parameters' names, in gradient-slot order."""
        return tuple(p.name for p in sorted((p for p in self.params if p.learnable),
                                            key=lambda p: p.grad_slot))

    @property
    def num_columns(self) -> int:
        """Columns of theta: a scalar takes one, a vector one per element."""
        return sum(p.width for p in self.params)

    @property
    def num_grads(self) -> int:
        """Columns of the parameter gradients: one per learnable scalar or element."""
        return sum(p.width for p in self.params if p.learnable)

    @property
    def grad_labels(self) -> tuple[str, ...]:
        """Each gradient column's scalar as formulas write it (b, w[0], ...), in order."""
        return tuple(label for name in self.learnable for label in self.param(name).labels())

    @property
    def clamp_positions(self) -> bool:
        """The logit reads i or j: a padding token's negative position reads as 0 (a formula is
        only checked over real tokens' positions, docs/priors.md "Positions")."""
        return "i" in self.reads or "j" in self.reads

    @property
    def uses_n(self) -> bool:
        """The logit reads n, the number of keys a query sees."""
        return "n" in self.reads

    @property
    def table(self) -> bool:
        """The GPU kernels gather the prior from a distance table."""
        return self.strategy == "table"

    @property
    def table_path(self) -> bool:
        """The CPU path's fused distance-table path: the logit is s + f(d)."""
        return self.distance_only and self.score_is_s

    @property
    def table_width(self) -> int:
        """Floats per distance of the dQ kernel's interleaved table (the log-prior and each
        tabulated derivative side by side, in groups of four); 0 where no derivative is
        tabulated and dQ reads the forward's table."""
        if not self.table or not self.table_grads:
            return 0
        return 4 * -(-(1 + len(self.table_grads)) // 4)

    @property
    def tile_row_sums(self) -> bool:
        """The dQ kernel reduces its correction's row sums per key tile (two or more learnable
        scalars: registers for wider tiles)."""
        return self.num_grads >= 2

    def param(self, name: str) -> ParamTraits:
        return next(p for p in self.params if p.name == name)


def position_table_traits(traits: PriorTraits) -> PriorTraits | None:
    """The traits of the kernels that read a table prior at integer position tensors
    (docs/positions.md, "Integer positions"): the prior's own table lowering and hooks, with its
    positions read from the tensors (PosQ, PosK) and the table entry of each score at
    d = pos_i - pos_j, no block skipping (the window's tiles are over token distances), no
    position gradients (integer positions take none), tiles of their own. None where that
    does not apply: an inline prior (its positional plan computes the prior per score, as
    fast), a score other than s + log_prior (the row factors read token positions), several
    channels, or per-distance sums of dS (T5's many buckets: they need the Toeplitz tiles of
    token positions)."""
    if not (traits.table and traits.score_is_s and traits.distance_only and traits.channels == 1
            and not traits.tensor_positions and not traits.row_factors and not traits.dist_sums
            and not traits.ramp):   # (a ramp reads token positions; the compiler gives tables none)
        return None
    return replace(traits, skip=None, tensor_positions=True, table_positions=True,
                   tile_kind="positions_table")
