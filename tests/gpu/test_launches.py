"""benchmarks/launches.py: what a call of the Triton path launches, counted on the CPU, from the
calls a user makes (an inference forward, a training step, a generation step)."""
from __future__ import annotations

import os
import subprocess
import sys

import bamgen
from bamgen.resources import shipped_prior
from bamgen.runtime.triton import launch
from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "launches.py"


def test_each_call_launches_its_kernels_and_a_table_prior_its_table():
    """With sm_90's tiles: NoPE's forward launches its kernel alone (no table, no parameters,
    and no fill: the per-row key counts it does not read are an unfilled placeholder), a
    training step the forward, preprocess,
    dK/dV and dQ kernels, a generation step the split-KV decode kernel and its combine; GGD's
    calls launch the same kernels and its distance table's (two kernels: 38 torch operations
    before it, 74 in a training step), and a few operations more (its parameters' columns
    joined, their gradients); FIRE's 99 scalars take 13 dQ launches of 8 (tiles.GRAD_GROUPS)
    beside its forward, preprocess and dK/dV. The launchers and the tile family are put back
    after."""
    script = load_script(SCRIPT, "launches")
    fns = (launch.forward_kernels, launch.decode, launch.backward_kernels, launch.distance_table)
    defaults = [fn.__defaults__ for fn in fns]
    family = os.environ.get("BAMGEN_INTERPRET_TILES")
    nope = script.count(bamgen.load(shipped_prior("uniform")), 40)
    ggd = script.count(bamgen.load(shipped_prior("generalized_gaussian")), 40)
    fire = script.count(bamgen.load(shipped_prior("fire")), 40)
    assert [fn.__defaults__ for fn in fns] == defaults
    assert os.environ.get("BAMGEN_INTERPRET_TILES") == family
    assert {call: kernels for call, (_, kernels, _) in nope.items()} == {
        "forward": 1, "training step": 4, "generation step": 2}
    assert nope["forward"][2] == nope["generation step"][2] == {}
    for call, (ops, kernels, _) in ggd.items():
        assert kernels == nope[call][1] + 2, call
        assert ops <= nope[call][0] + 10, (call, ops)
    assert fire["training step"][1] == 3 + 13


def test_the_table_and_a_bad_prior_name_from_the_command_line(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--priors", "uniform", "--n", "24"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| uniform | 0 + 1 | 2 + 4 | 0 + 2 |" in res.stdout, res.stdout
    res = subprocess.run([sys.executable, str(SCRIPT), "--priors", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "'nope' is not a shipped prior; choose from" in res.stderr
    assert "Traceback" not in res.stderr
