"""Which tiles a prior's kernels take: the compiler names the kind (PriorTraits.tile_kind), and
the runtime keeps the tile table of each kind (bamgen/runtime/triton/tiles.py says which tiles
suit which kinds, and how they were checked). Register pressure decides, and it depends on what
the main loop computes per score:

* ``light``: nothing or a causal-side ramp (NoPE, ALiBi) — the largest tiles;
* ``table``: a gathered table entry, and in dQ the derivative tables (GGD, BAM, Cauchy, KERPLE);
* ``dist``: a table prior whose dQ kernel sums dS per distance (T5);
* ``heavy``: many scalars, read from memory per score (FIRE);
* ``general``: a printed expression per score, or a score other than s + log_prior (SSMax).
"""
from __future__ import annotations

from .lower import KernelPlan


def tile_kind(plan: KernelPlan) -> str:
    """Which tile table a prior's kernels use (see the module docstring)."""
    if not plan.score_is_identity:
        return "general"
    if plan.strategy == "table":
        from .codegen import dist_sums   # (codegen decides it for the traits too)
        return "dist" if dist_sums(plan) else "table"
    if plan.vectors_in_memory:
        return "heavy"
    return "light" if plan.ramp is not None or not plan.has_bias_hook else "general"
