"""What the compiler knows about a prior, as the runtime reads it: frozen dataclasses that the
compiler prints into each generated module (``TRAITS``) and that the runtime, bamgen.distributed
and the integrations read. Facts travel here as fields; nothing downstream parses a formula.

No torch import: the compiler builds these too (docs/architecture.md, "Traits").
"""
from __future__ import annotations

from dataclasses import dataclass

# The interface between a generated module and bamgen.runtime. A module built for another ABI
# is refused at import with a message that says to rebuild it (its cache key covers this number).
RUNTIME_ABI = 1


@dataclass(frozen=True)
class ParamTraits:
    """One runtime parameter of a prior: its column in the [Hq, P] parameter tensor theta and
    its domain (kind "real", "positive", "nonnegative" or "interval" with the open bounds)."""
    name: str
    slot: int
    learnable: bool
    per_head: bool
    domain: str
    lo: float | None = None
    hi: float | None = None
    grad_slot: int | None = None     # its column among the learnable parameters' gradients


# How the dQ kernel takes each learnable parameter's per-score derivative (PriorTraits.grad_modes)
GRAD_CLAMPED = 0      # a printed derivative: clamped to float32's range, 0 where P is 0
GRAD_TABLE = 1        # a table entry, clamped on the host and 0 where the prior is -inf
GRAD_LOGIT_FACTOR = 2  # the logit's own per-score factor u: finite wherever P > 0


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
    position (an inline prior that reads i, j or n: a part of the derivative that is constant
    along a row meets sum_j dS = 0, and in float32 its size would swamp the gradient).
    tile_kind: which tile table the kernels use (bamgen/runtime/triton/tiles.py)."""
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

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def learnable(self) -> tuple[str, ...]:
        """The learnable parameters' names, in gradient-slot order."""
        return tuple(p.name for p in sorted((p for p in self.params if p.learnable),
                                            key=lambda p: p.grad_slot))

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
        parameters: registers for wider tiles)."""
        return len(self.learnable) >= 2

    def param(self, name: str) -> ParamTraits:
        return next(p for p in self.params if p.name == name)
