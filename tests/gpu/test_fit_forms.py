"""benchmarks/fit_forms.py: other forms of the calibrated model, fitted and left out point by
point as the shipped fit is."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "fit_forms.py"
forms = load_script(SCRIPT, "fit_forms")


def _points(n=24):
    """Points whose forward costs the issue unit and whose backward kernels cost twice their
    tensor unit: one sum of units cannot fit both, a sum per kernel can."""
    import random
    rng = random.Random(1)
    mc = forms.mc
    points = []
    for i in range(n):
        kernel = forms.KERNELS[i % 3]
        units = {u: rng.uniform(50, 300) for u in forms.TERMS}
        measured = units["issue"] if kernel == "fwd" else 2 * units["tensor"]
        points.append(mc.Point(f"p{i}", 128, kernel, max(units.values()), measured, "NVIDIA H100",
                               tuple(sorted(units.items()))))
    return points


def test_a_form_with_the_missing_structure_fits_every_point_and_the_shipped_one_does_not():
    rows = {line.split("|")[1].strip(): line for line in forms.table(_points())[2:]}
    assert set(rows) == set(forms.FORMS)
    assert "24 of 24" in rows["per kernel"]
    assert "24 of 24" not in rows["sum (shipped)"]


def test_leave_one_out_leaves_out_the_point_s_own_kernel_of_its_prior():
    """A point alone of its kind is predicted by the others' fit: a per-kernel form with one
    dQ point has no weight for it and predicts 0 (-100%)."""
    points = [p for p in _points() if p.kernel != "dq"] + [_points()[2]]
    errors = forms.leave_one_out(points, forms._per_kernel)
    assert errors[-1] == pytest.approx(-1.0)


def _cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT)


def test_the_shipped_pairs_print_a_row_per_form():
    res = _cli(ROOT / "docs/results/gpu/h200_2026-11-26_pairs.json")
    assert res.returncode == 0, res.stderr
    assert sum(line.startswith("| ") for line in res.stdout.splitlines()) == len(forms.FORMS) + 1


@pytest.mark.parametrize("case", ["missing", "no latency", "too few"])
def test_a_bad_pairs_file_is_named(tmp_path, case):
    path = tmp_path / "pairs.json"
    point = {"prior": "uniform", "head_dim": 128, "kernel": "fwd", "modelled": 1.0, "measured": 1.0,
             "device": "d", "units": [["tensor", 1.0]], "arch": "sm_90"}
    if case == "no latency":
        path.write_text(json.dumps([point] * 30))
    elif case == "too few":
        point["units"] = [[t, 1.0] for t in forms.TERMS]
        path.write_text(json.dumps([point] * 3))
    res = _cli(path)
    says = {"missing": "is not a benchmarks/model_check.py --pairs file",
            "no latency": "30 of 30 points lack the latency term",
            "too few": "3 points: the forms need more than 18"}[case]
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
