"""Other forms of the calibrated model, fitted to the same points: does a form the shipped fit
lacks bring more of them within 15% under leave-one-out? (docs/performance.md, "The fit's
form and Triton 3.6's stacks").

    python benchmarks/fit_forms.py docs/results/gpu/*pairs*.json

Each form is a list of features of a point, every one a non-negative weight's term, fitted to
relative error as model_check.fit_units fits the sum of units (non-negative least squares), and
each point predicted by the fit of the points of other priors or kernels (model_check._kin), as
model_check.leave_one_out_fit does. The forms:

- sum: the shipped fit, the five units and the latency term summed;
- max + sum: the slowest unit (the raw model's bound) as one more term beside them;
- max + sum, latency in the max: the slowest of the units and the latency term;
- per kernel: the sum with its own weights for the forward, dK/dV and dQ kernels;
- per head dim: the sum with its own weights at head dims 64 and 128;
- sqrt: the sum and the geometric mean of the latency term and the slowest unit (a partial
  overlap).

The points must carry the latency term (pairs written since "Latency and occupancy, tested").
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_check as mc  # noqa: E402

TERMS = mc.UNITS + (mc.LATENCY,)
KERNELS = ("fwd", "dkdv", "dq")
HEAD_DIMS = (64, 128)


def _units(p: mc.Point) -> dict[str, float]:
    return dict(p.units)


def _sum(p):
    u = _units(p)
    return [u[t] for t in TERMS]


def _max_sum(p):
    u = _units(p)
    return [max(u[t] for t in mc.UNITS)] + _sum(p)


def _max_latency_sum(p):
    u = _units(p)
    return [max(u[t] for t in TERMS)] + _sum(p)


def _per_kernel(p):
    return [x if p.kernel == kernel else 0.0 for kernel in KERNELS for x in _sum(p)]


def _per_head_dim(p):
    return [x if p.head_dim == dim else 0.0 for dim in HEAD_DIMS for x in _sum(p)]


def _sqrt(p):
    u = _units(p)
    return _sum(p) + [math.sqrt(u[mc.LATENCY] * max(u[t] for t in mc.UNITS))]


FORMS = {"sum (shipped)": _sum, "max + sum": _max_sum, "max + sum, latency in the max": _max_latency_sum,
         "per kernel": _per_kernel, "per head dim": _per_head_dim, "sqrt": _sqrt}


def fit(points, features) -> list[float]:
    """The form's non-negative weights, to relative error."""
    import torch
    a = torch.tensor([[f / p.measured for f in features(p)] for p in points], dtype=torch.float64)
    return mc._nnls(a, torch.ones(len(points), dtype=torch.float64)).tolist()


def predict(p, weights, features) -> float:
    return sum(w * f for w, f in zip(weights, features(p)))


def leave_one_out(points, features) -> list[float]:
    """Each point's relative error under the fit of the points not of its kernel and prior."""
    return [predict(p, fit([q for q in points if not mc._kin(p, q)], features), features)
            / p.measured - 1 for p in points]


def table(points) -> list[str]:
    lines = ["| form | weights | within 15% (leave one out) | median \\|error\\| | worst |",
             "|---|---:|---:|---:|---:|"]
    for name, features in FORMS.items():
        errors = leave_one_out(points, features)
        worst = max(errors, key=abs)
        lines.append(f"| {name} | {len(features(points[0]))} | "
                     f"{sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} | "
                     f"{statistics.median(abs(e) for e in errors):.1%} | {worst:+.0%} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pairs", nargs="+", help="benchmarks/model_check.py --pairs files")
    args = ap.parse_args(argv)
    try:
        points = mc.read_pairs(args.pairs)
    except ValueError as err:
        ap.error(str(err))
    lacking = [p for p in points if mc.LATENCY not in dict(p.units)]
    if lacking:
        ap.error(f"{len(lacking)} of {len(points)} points lack the latency term: give pairs files "
                 f"written since it (docs/performance.md, \"Latency and occupancy, tested\")")
    weights = len(TERMS) * len(KERNELS)   # the largest form's
    if len(points) <= weights:
        ap.error(f"{len(points)} points: the forms need more than {weights}")
    print("\n".join(table(points)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
