"""benchmarks/model_terms.py: candidate terms for the throughput model, tested on the GPU runs'
points with their kernels compiled again at the commit that wrote them."""
import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "model_terms.py"
terms = load_script(SCRIPT, "model_terms")


def _point(prior="uniform", kernel="fwd", measured=300.0, units=None):
    mc = terms._model_check()
    units = units or {"tensor": 100.0, "mufu": 50.0, "fp32": 40.0, "issue": 90.0, "lsu": 30.0}
    return mc.Point(prior, 128, kernel, max(units.values()), measured, "NVIDIA H100",
                    tuple(sorted(units.items())))


def test_a_variant_s_pins_come_from_its_name():
    assert terms.pins_of("ggd") == {}
    assert terms.pins_of("ggd@gather=async") == {"gather": "async"}
    assert terms.pins_of("uniform@fwd=128x64x8x3,gather=coalesced") == {
        "tiles": {"fwd": [128, 64, 8, 3]}, "gather": "coalesced"}
    # (what make gpu-check's variants step names: gpu_check.VARIANT_PEERS)
    assert terms.pins_of("uniform@kv=pointers,fwd=128x64x8x3,dq_split=off,dkdv_split=on") == {
        "tiles": {"fwd": [128, 64, 8, 3]}, "kv": "pointers", "dq_split": False, "dkdv_split": True}
    # (the decode variant's table build, and FIRE's dQ group size: docs/performance.md)
    assert terms.pins_of("ggd@table=host") == {"table": "host"}
    assert terms.pins_of("fire@dq_group=6") == {"dq_group": 6}


def test_the_terms_join_the_point_s_units():
    point = _point()
    shared = {"units": dict(point.units), "path": 2000.0, "scale": 1000 / (128 * 64)}
    one = dict(terms.with_terms(point, {**shared, "ctas": 1}).units)
    two = dict(terms.with_terms(point, {**shared, "ctas": 2}).units)
    assert one["latency"] == pytest.approx(2000 * 1000 / 8192)
    assert two["latency"] == pytest.approx(one["latency"] / 2)    # another CTA fills the waits
    assert one["issue (single CTA)"] == 90.0 and two["issue (single CTA)"] == 0.0
    assert {u: one[u] for u in terms.UNITS} == dict(point.units)


def test_a_recompiled_kernel_is_the_same_only_within_two_percent():
    point = _point()
    units = dict(point.units)
    assert terms.same_kernel(point, {"units": {**units, "issue": 91.0}})
    assert not terms.same_kernel(point, {"units": {**units, "issue": 95.0}})


def test_the_report_fits_each_term_set_and_a_term_that_explains_a_miss_helps():
    """Points whose measured cycles are the issue unit plus a latency the units do not carry:
    the five units miss them, the latency term fits them."""
    import random
    rng = random.Random(0)
    points = []
    for i in range(14):
        units = {u: rng.uniform(50, 300) for u in terms.UNITS}
        path, ctas = rng.uniform(500, 4000), rng.choice([1, 2])
        latency = path * (1000 / 8192) / ctas
        point = _point(f"p{i}", "fwd", units["issue"] + latency, units)
        points.append(terms.with_terms(point, {"units": units, "path": path, "ctas": ctas,
                                               "scale": 1000 / 8192}))
    lines = terms.report(points)
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert "14 of 14" in rows["+ latency"]
    assert "14 of 14" not in rows["the five units"]
    assert sum(re.match(r"\| p\d+ \|", line) is not None for line in lines) == 14


def _cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT)


@pytest.mark.parametrize("case", ["missing", "no commit", "bad commit", "not pairs", "bad predict",
                                  "bad pins", "bad at"])
def test_a_bad_argument_is_named_before_anything_compiles(tmp_path, case):
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps([]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prior": "uniform"}]))
    args, says = {
        "missing": ([f"{tmp_path / 'missing.json'}@HEAD"], "cannot read"),
        "no commit": ([pairs], "expected PAIRS@COMMIT"),
        "bad commit": ([f"{pairs}@no-such-commit"], "'no-such-commit' is not a commit"),
        "not pairs": ([f"{bad}@HEAD"], "is not a model_check.py --pairs file"),
        "bad predict": ([f"{pairs}@HEAD", "--predict", "alibi"], "--predict alibi: the prior is one of"),
        "bad pins": ([f"{pairs}@HEAD", "--predict", "ggd@gather=fast"], "is not gather=async"),
        "bad at": ([f"{pairs}@HEAD", "--predict", "ggd", "--at", "nope"], "--at: 'nope' is not a commit"),
    }[case]
    res = _cli(*args)
    assert res.returncode == 2 and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_pins_name_what_they_pin():
    with pytest.raises(ValueError, match="'fwd=128x64'"):
        terms.pins_of("ggd@fwd=128x64")
    with pytest.raises(ValueError, match=r"'kv=ptr' is not .* kv=pointers\|tma"):
        terms.pins_of("uniform@kv=ptr")


def test_add_latency_writes_the_term_into_the_matched_points_only(tmp_path):
    pairs = tmp_path / "pairs.json"
    units = [["fp32", 1.0], ["issue", 2.0], ["lsu", 3.0], ["mufu", 4.0], ["tensor", 5.0]]
    pairs.write_text(json.dumps([{"prior": "uniform", "kernel": "fwd", "units": units},
                                 {"prior": "ggd", "kernel": "fwd", "units": units + [["latency", 9.0]]},
                                 {"prior": "fire", "kernel": "fwd", "units": units}]))
    terms.add_latency(str(pairs), {0: {"path": 800.0, "scale": 0.5, "ctas": 2},
                                   1: {"path": 100.0, "scale": 1.0, "ctas": 1}})
    points = json.loads(pairs.read_text())
    assert dict(points[0]["units"])["latency"] == 200.0
    assert dict(points[1]["units"])["latency"] == 100.0 and len(points[1]["units"]) == 6
    assert points[2]["units"] == units    # its kernel compiled otherwise: left as it was
