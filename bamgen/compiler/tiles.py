"""Which tiles a prior's kernels take: the compiler names the kind (PriorTraits.tile_kind), and
the runtime keeps the tile table of each kind (bamgen/runtime/triton/tiles.py says which tiles
suit which kinds, and how they were checked). Register pressure decides, and it depends on what
the main loop computes per score:

* ``light``: nothing or a causal-side ramp (NoPE, ALiBi) — the largest tiles;
* ``table``: a gathered table entry, and in dQ the derivative tables (GGD, BAM, Cauchy, KERPLE);
* ``dist``: a table prior whose dQ kernel sums dS per distance (T5);
* ``heavy``: many scalars, read from memory per score (FIRE);
* ``general``: a printed expression per score, or a score other than s + log_prior (SSMax);
* ``positions_light``, ``positions``, ``positions_vectors`` and ``positions_heavy``: the
  positional plan (position tensors, docs/positions.md), whose kernels also load each tile's
  positions and keep the positions' gradient terms: a bias of a few operations and no
  learnable parameter (FoX's d), more, scalars read from memory (T5's buckets), or those with
  a long position derivative (FIRE's MLP, whose derivative is the MLP's backward per score).
"""
from __future__ import annotations

from .lower import KernelPlan


# the positional plan's per-score cost (lower._costs' units) up to which a prior without
# learnable parameters takes the light tiles (FoX: 3); a learnable one keeps two accumulators
# per parameter in dQ beside the positions' three
POSITIONS_LIGHT_COST = 6
# ... and above which a prior of vectors read from memory takes the positions_heavy tiles: its
# position derivative is a long computation per score (FIRE's MLP backward: 1251), where T5's
# buckets (26) take positions_vectors, whose dK/dV tiles are twice the size
POSITIONS_HEAVY_COST = 200


def tile_kind(plan: KernelPlan) -> str:
    """Which tile table a prior's kernels use (see the module docstring)."""
    if plan.tensor_positions:
        if plan.vectors_in_memory:
            heavy = dict(plan.cost)["inline"] > POSITIONS_HEAVY_COST
            return "positions_heavy" if heavy else "positions_vectors"
        light = not plan.learnable and dict(plan.cost)["inline"] <= POSITIONS_LIGHT_COST
        return "positions_light" if light else "positions"
    if not plan.score_is_identity:
        return "general"
    if plan.strategy == "table":
        from .codegen import dist_sums   # (codegen decides it for the traits too)
        return "dist" if dist_sums(plan) else "table"
    if plan.vectors_in_memory:
        return "heavy"
    return "light" if plan.ramp is not None or not plan.has_bias_hook else "general"
