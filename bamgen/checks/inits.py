"""The inits of a prior's parameters, computed as the module's default_params computes them,
for every head of every ordinary head count (1 to numeric.MAX_HEADS; the compiler's spec stage
checks their syntax; this runs them, in float64 arithmetic kept as float32, on numeric.py's
grids). A random init is checked by its bounds in the spec stage. A module built for more heads
checks its own inits and names the parameter, head and value that fail (default_params)."""
from __future__ import annotations

import torch

from ..compiler.spec import PriorSpec
from ..compiler.timeout import cpu_budget, working_on
from ..errors import SpecError
from ..runtime.params import describe_domain
from ..runtime.traits import ParamTraits
from . import numeric


def check_inits(spec: PriorSpec) -> None:
    """Every init for every head of every ordinary head count (up to numeric.MAX_HEADS), as
    the module's default_params computes and stores it (float64 arithmetic, kept as float32),
    within a CPU budget."""
    params = [p for p in spec.params if not p.is_constant and p.random is None]
    if not params:
        return
    work = 0
    for p in params:
        work += numeric.grid_operations(p.init_expr)
        if work > numeric.MAX_INIT_OPERATIONS:
            raise SpecError(f"the inits up to this one have {work} operations in h and H; the "
                            f"limit is {numeric.MAX_INIT_OPERATIONS} in all (each is computed for "
                            f"every head of every head count up to {numeric.MAX_HEADS})",
                            field=f"params.{p.name}.init", line=p.line,
                            hint="simplify the inits, or give numbers")
    with cpu_budget("params", "checking the inits"):
        for p in params:
            field = f"params.{p.name}.init"
            with working_on(field, "checking the init"):
                problem = numeric.init_problem(p.init_expr, p.domain.inside, str(p.domain))
            if problem:
                raise SpecError(f"the init {problem}", field=field, line=p.line,
                                hint=_init_hint(p))


def init_problem_at(spec: PriorSpec, heads: int) -> str | None:
    """Why the module built for ``heads`` heads would refuse its own inits, in the words it
    refuses them (default_params, then the constructor's domain check), or None. For a head
    count above numeric.MAX_HEADS, which the build does not check: `bamgen show --heads 250`
    would otherwise analyse nan."""
    for p in spec.params:
        if p.is_constant or p.random is not None or not p.init_expr.free_symbols:
            continue   # (one number for every head: checked by the build)
        rows = heads if p.size is None or p.per_head else 1
        grid = {"h": torch.arange(rows, dtype=torch.float64),
                "H": torch.full((rows,), float(heads), dtype=torch.float64)}
        values = numeric.evaluate_tensor(p.init_expr, {s: grid[s.name]
                                                       for s in p.init_expr.free_symbols})
        values = values.expand(rows)
        if not bool(torch.isfinite(values).all()):
            head = int(torch.nonzero(~torch.isfinite(values))[0])
            return (f"the init of {p.name} cannot be computed for head {head} of {heads} (it "
                    f"gives {float(values[head])!r}); build the module for another number of "
                    f"heads or change the init in the prior file")
        outside = ~p.domain.inside(values.to(torch.float32))
        if bool(outside.any()):
            head = int(torch.nonzero(outside)[0])
            traits = ParamTraits(p.name, 0, p.learnable, p.per_head, p.domain.kind,
                                 p.domain.lo, p.domain.hi)
            return (f"init: {p.name} must be {describe_domain(traits)} and finite (its domain "
                    f"in the prior file), got {float(values[head].float())!r} for head {head}")
    return None


def _init_hint(p) -> str:
    """A number is fixed by another number; a formula in h and H by what the heads give."""
    if not p.init_expr.free_symbols:
        return p.domain.init_hint()
    return (f"inits are checked for every head count up to {numeric.MAX_HEADS}; init may use "
            f"h (head index, 0-based) and H (number of heads)")
