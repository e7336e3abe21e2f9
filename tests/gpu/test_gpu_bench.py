"""benchmarks/gpu.py works without a GPU: its --quick smoke run (Triton interpreter, tiny sizes)
prints the tables and passes its own checks, and a failed check or a missing GPU is an error."""
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _load_script():
    return load_script(SCRIPT, "bench_gpu")


def test_quick_gpu_benchmark_runs(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    report = tmp_path / "report.md"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--markdown", str(report)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "interpreter smoke run: timings are not GPU figures" in out, out
    for peer in ("bamgen-ggd", "bamgen-laplace", "bamgen-uniform", "bamgen-ggd-torch", "sdpa",
                 "flex-ggd"):
        assert f"| 48 | 1 | 16 | {peer} |" in out, out
    assert "| 48 | 16 | bamgen-ggd |" in out and "fwd / flex" in out, out
    assert "fa2-alibi: no GPU" in out, out
    # the checks ran: the interpreted kernels against the torch backend, the peers' functions
    for check in ("bamgen-ggd vs bamgen-ggd-torch fwd+grads", "bamgen-laplace vs flex-laplace fwd",
                  "bamgen-uniform vs sdpa fwd"):
        assert check in out, out
    # the decode step: every peer timed, and the decode kernels checked against the forward
    # kernel, the CPU decode step, flex with the same prior and (no prior) SDPA
    for peer in ("sdpa", "flex-ggd", "bamgen-ggd", "bamgen-ggd-forward", "bamgen-ggd-torch",
                 "bamgen-laplace", "bamgen-uniform"):
        assert f"| 80 | 2 | 2/1 | 16 | {peer} |" in out, out
    for check in ("decode bamgen-ggd vs flex-ggd", "decode bamgen-ggd vs bamgen-ggd-forward",
                  "decode bamgen-ggd vs bamgen-ggd-torch", "decode bamgen-uniform vs sdpa"):
        assert check in out, out
    _check_markdown_report(report.read_text())


def _check_markdown_report(text):
    """--markdown (what make gpu-check keeps): one table, times and ratios of every peer."""
    lines = text.splitlines()
    assert sum(line.startswith("|---") for line in lines) == 1, text
    header = next(line for line in lines if line.startswith("| D |"))
    assert header == ("| D | N | B | peer | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | "
                      "fwd / sdpa | bwd / sdpa | fwd / flex | bwd / flex | fwd / fa2-alibi | "
                      "bwd / fa2-alibi | first s |"), header
    rows = {line.split(" | ")[3]: line for line in lines if line.startswith("| 16 | 48 |")}
    assert set(rows) >= {"sdpa", "flex-ggd", "bamgen-ggd", "bamgen-laplace", "bamgen-uniform"}
    cells = rows["bamgen-ggd"].strip("| ").split(" | ")
    assert cells[8] != "-" and cells[10] != "-" and cells[12] == "-", cells   # sdpa, flex; no fa2
    assert "fa2-alibi: no GPU" in text and "bamgen-ggd vs flex-ggd fwd" in text, text
    decode = {line.split(" | ")[3]: line for line in lines if line.startswith("| 16 | 80 | 2 |")}
    assert set(decode) >= {"sdpa (decode)", "flex-ggd (decode)", "bamgen-ggd (decode)"}, text
    cells = decode["bamgen-ggd (decode)"].strip("| ").split(" | ")
    assert cells[5] == "-" and cells[8] != "-" and cells[10] != "-", cells   # no bwd; sdpa, flex


def test_a_failed_check_is_reported():
    bench = _load_script()
    results = [{"N": 32, "D": 16, "agreement": {"a vs b fwd": 1e-7, "c vs d fwd+grads": 3e-3,
                                                 "e vs f fwd": float("nan")}}]
    failed = bench.failed_checks(results)
    assert len(failed) == 2 and "c vs d" in failed[0] and "e vs f" in failed[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_the_full_run_says_so(capsys):
    assert _load_script().main([]) == 1
    assert "no GPU" in capsys.readouterr().out


def test_the_field_priors_score_mods_compute_the_modules_functions():
    """flex-t5, flex-fire and flex-fox (FoX over per-head positions, with gradients to them) are
    the same functions as the generated modules: the smoke run's agreement check holds them to
    1e-4 (the Triton kernels for t5 and fox, the torch backend for fire)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--n", "32", "--decode-n", "--peers",
                          "flex-t5", "bamgen-t5", "flex-fox", "bamgen-fox", "flex-fire",
                          "bamgen-fire-torch"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for check in ("bamgen-t5 vs flex-t5 fwd", "bamgen-fox vs flex-fox fwd",
                  "bamgen-fire-torch vs flex-fire fwd"):
        assert check in res.stdout, res.stdout


def test_a_strategy_variant_runs_beside_the_shipped_build():
    """bamgen-<prior>-<strategy>: the prior built with the other lowering, timed in the same run
    as the shipped build and held to its output (issue: the model cannot decide every choice)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--n", "32", "--decode-n", "--peers",
                          "bamgen-laplace", "bamgen-laplace-table"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| 32 | 1 | 16 | bamgen-laplace-table |" in res.stdout, res.stdout
    assert "bamgen-laplace-table vs bamgen-laplace fwd" in res.stdout, res.stdout


def test_randomized_integer_positions_run_the_table_beside_inline_and_flex():
    """bamgen-rpe (GGD at sorted random integer positions: the distance table in the kernels),
    bamgen-rpe-inline (the same positions, the prior per score) and flex-rpe (the positions in
    its score_mod) compute one function: the smoke run's agreement check holds them together,
    so that a GPU run can time the table against the inline kernels (docs/positions.md)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--n", "32", "--decode-n", "--peers",
                          "flex-rpe", "bamgen-rpe", "bamgen-rpe-inline", "bamgen-rpe-torch"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for check in ("bamgen-rpe vs flex-rpe fwd", "bamgen-rpe vs bamgen-rpe-torch fwd+grads",
                  "bamgen-rpe-inline vs bamgen-rpe fwd"):
        assert check in res.stdout, res.stdout


def test_a_pinned_variant_runs_beside_its_base_peer(tmp_path):
    """bamgen-<prior>@<pins> (a kernel variant the model cannot rank: make gpu-check's variants
    step) is timed in the same run as its base peer and held to it, forward and every gradient,
    and so is a pinned decode peer; the JSON keeps the pins for benchmarks/model_check.py."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = tmp_path / "run.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--n", "32", "--decode-n", "80",
                          "--decode-batch", "2", "--peers", "bamgen-ggd", "bamgen-ggd@gather=coalesced",
                          "bamgen-ggd@fwd=16x16x4x1,bwd_dq=16x16x4x1,dq_split=off,dq_group=1", "--decode-peers", "bamgen-ggd",
                          "bamgen-ggd@gather=coalesced", "bamgen-ggd@table=host", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for check in ("bamgen-ggd@gather=coalesced vs bamgen-ggd fwd+grads",
                  "bamgen-ggd@fwd=16x16x4x1,bwd_dq=16x16x4x1,dq_split=off,dq_group=1 vs bamgen-ggd fwd+grads",
                  "decode bamgen-ggd@gather=coalesced vs bamgen-ggd",
                  "decode bamgen-ggd@table=host vs bamgen-ggd"):   # (the host's table: the same)
        assert check in res.stdout, res.stdout
    import json
    training = json.loads(out.read_text())["results"][0]
    assert training["variants"]["bamgen-ggd@fwd=16x16x4x1,bwd_dq=16x16x4x1,dq_split=off,dq_group=1"] == {
        "tiles": {"bwd_dq": [16, 16, 4, 1], "fwd": [16, 16, 4, 1]}, "gather": None,
        "dq_split": False, "dkdv_split": None, "kv": None, "table": None, "dq_group": 1}


@pytest.mark.parametrize("argv, words", [
    (["--peers", "bamgen-ggd", "--backward-peers", "bamgen-ggd"], "without --forward-only"),
    (["--forward-only", "--peers", "bamgen-ggd", "--backward-peers", "bamgen-uniform"],
     "--backward-peers bamgen-uniform: not among --peers"),
    (["--forward-only", "--backward-peers", "bamgen-ggd"], "not among --peers"),
])
def test_backward_peers_outside_a_forward_only_run_of_those_peers_are_refused(argv, words, capsys):
    gpu = _load_script()
    with pytest.raises(SystemExit) as exit_:
        gpu.parse_args(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_a_forward_only_run_times_the_backward_of_its_backward_peers(tmp_path):
    """--backward-peers (make gpu-check's dK/dV variant): under --forward-only those peers'
    backwards are timed and held to each other, the rest stay forwards."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = tmp_path / "run.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--n", "32", "--decode-n",
                          "--forward-only", "--peers", "bamgen-uniform",
                          "bamgen-uniform@dkdv_split=off,bwd_dkdv=16x32x4x2", "bamgen-ggd",
                          "--backward-peers", "bamgen-uniform",
                          "bamgen-uniform@dkdv_split=off,bwd_dkdv=16x32x4x2", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "bamgen-uniform@dkdv_split=off,bwd_dkdv=16x32x4x2 vs bamgen-uniform fwd+grads" in res.stdout
    import json
    run = json.loads(out.read_text())
    assert run["env"]["launch_us"] > 0   # a launch's host cost, beside the calls' times
    assert f"launch takes {run['env']['launch_us']:.1f} us of host time" in res.stdout
    peers = run["results"][0]["peers"]
    assert peers["bamgen-uniform"]["bwd_s"] is not None
    assert peers["bamgen-uniform@dkdv_split=off,bwd_dkdv=16x32x4x2"]["bwd_s"] is not None
    assert peers["bamgen-ggd"]["bwd_s"] is None
    # each timed call's host seconds beside it (on the CPU the call is all host: the same)
    for name, times in peers.items():
        assert times["fwd_host_s"] == times["fwd_s"] > 0, (name, times)
        assert times["bwd_host_s"] == times["bwd_s"], (name, times)


@pytest.mark.parametrize("flag, name, words", [
    ("--peers", "flex-ggd@gather=direct", "only a bamgen peer on the Triton kernels takes pins"),
    ("--peers", "bamgen-ggd-torch@gather=direct", "only a bamgen peer on the Triton kernels"),
    ("--peers", "bamgen-ggd@gather=shared", "gather= one of async, coalesced, direct"),
    ("--peers", "bamgen-ggd@fwd=128x64", "write <kernel>=<BLOCK_M>x<BLOCK_N>x<warps>x<stages>"),
    ("--peers", "bamgen-ggd@dq_split=yes", "or dq_split=on|off"),
    ("--peers", "bamgen-ggd@dq_split=on,dq_split=off", "pin 'dq_split' given twice"),
    ("--peers", "bamgen-ggd@dkdv_split=1", "or dq_split=on|off, dkdv_split=on|off"),
    ("--peers", "bamgen-uniform@kv=ptr", "kv=pointers|tma"),
    ("--peers", "bamgen-uniform@kv=tma,kv=pointers", "pin 'kv' given twice"),
    ("--peers", "bamgen-nope@gather=direct", "'bamgen-nope' is not a peer; choose from:"),
    ("--decode-peers", "bamgen-ggd-forward@gather=direct", "only a bamgen decode peer"),
])
def test_a_bad_pinned_peer_is_refused_by_name(flag, name, words, capsys):
    gpu = _load_script()
    with pytest.raises(SystemExit) as exit_:
        gpu.parse_args([flag, name])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and words in err, err


def test_a_run_stopped_within_a_size_keeps_the_rounds_it_finished(tmp_path, monkeypatch):
    """make gpu-check stops its benchmark step at a time limit: the step of the fifth GPU session
    kept nothing of the size it was in. The JSON now holds, after every round, the size's result
    so far, marked partial_rounds (no agreement or kernels, which it reads after the last
    round); a finished size replaces it."""
    import json
    gpu = _load_script()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = {"n": 0}
    timed = gpu.time_forward

    def stopped_in_round_three(timer, peer):
        calls["n"] += 1
        if calls["n"] == 7:   # two peers' warm-ups, then two a round: the third round's first
            raise KeyboardInterrupt("the step's time limit")
        return timed(timer, peer)
    monkeypatch.setattr(gpu, "time_forward", stopped_in_round_three)
    out = tmp_path / "run.json"
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--quick", "--n", "32", "--decode-n", "--forward-only", "--repeats", "4",
                  "--peers", "bamgen-uniform", "sdpa", "--json", str(out)])
    [partial] = json.loads(out.read_text())["results"]
    assert partial["partial_rounds"] == 2 and partial["N"] == 32
    assert set(partial["peers"]) == {"bamgen-uniform", "sdpa"}
    assert all(p["fwd_s"] > 0 for p in partial["peers"].values())
    assert partial["agreement"] == {} and "kernels" not in partial
    monkeypatch.setattr(gpu, "time_forward", timed)
    gpu.main(["--quick", "--n", "32", "--decode-n", "--forward-only", "--repeats", "2",
              "--peers", "bamgen-uniform", "sdpa", "--json", str(out)])
    [whole] = json.loads(out.read_text())["results"]
    assert "partial_rounds" not in whole and "bamgen-uniform vs sdpa fwd" in whole["agreement"]
