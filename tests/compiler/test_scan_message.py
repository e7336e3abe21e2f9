"""A scan failure names the failing point so that it can be rebuilt: every parameter the
failing expression reads, then others up to scan.MAX_SHOWN (docs/priors.md, "What the build
checks over the whole domain")."""
from __future__ import annotations

import re

from bamgen.checks.scan import MAX_SHOWN
from tests.helpers import run_cli_in_process, write_prior

# u comes first in the file but is not read; w's 12 elements and c are, c breaks it
MANY = """
name: many
log_prior: Sum(w[m]*cos(d/(m + 1)), (m, 0, 11)) + sqrt(c - 1)
params:
  u: {size: 12, init: 0.0}
  w: {size: 12, init: 0.0}
  c: {init: 2.0, domain: positive}
"""


def test_the_message_lists_every_parameter_the_formula_reads(tmp_path):
    res = run_cli_in_process("build", str(write_prior(tmp_path, MANY)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "\n" not in line and "field 'log_prior': the log-prior is nan at" in line, line
    names = re.findall(r"(\w+(?:\[\d+\])?) = ", line)
    assert names[1:] == [f"w[{k}]" for k in range(12)] + ["c"], line   # (after d)
    assert "c = 0.01" in line and line.count(" = ") > MAX_SHOWN and ", ..." in line
    assert not (tmp_path / "out").exists()


def test_a_scale_left_in_the_real_domain_is_named_with_its_fix(tmp_path):
    """-Abs(d)/b without domain: positive fails at b = 0; the hint says to declare the domain,
    not only to guard logs and poles."""
    text = "name: scale\nlog_prior: -Abs(d)/b\nparams:\n  b: {init: 2.0}\n"
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "b = 0" in line and "b = 0 is in the domain of b, real" in line, line
    assert "declare its domain: positive" in line, line


def test_a_formula_of_d_and_n_is_not_named_at_positions_it_does_not_read(tmp_path):
    """A formula of the distance and n alone is scanned over distances to 2**25 with stand-in
    positions (i = d, j = 0); the message named them, i = -33554432 against the hint's own
    |i| <= 2**24. It names n, s and the parameters (b = 1: log(b) = 0 divides), not d,
    which the score does not read either."""
    text = ("name: ssm\nscore: s*log(n)/log(b)\nlog_prior: 0\n"
            "params:\n  b: {init: 512.0, domain: positive}\n")
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "field 'score'" in line and "b = 1" in line, line
    names = re.findall(r"(\w+(?:\[\d+\])?) = ", line.split(" (hint")[0])
    assert names == ["n", "s", "b"], line


def test_a_score_of_s_alone_is_named_at_s_alone(tmp_path):
    """A score that reads neither the log-prior nor a position fails at a score s; the message
    named a distance too (d = -25165824), which the formula never reads."""
    text = "name: sonly\nscore: s + exp(s/2)\nlog_prior: 0\n"
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "\n" not in line and "field 'score': the logit is nan or +inf at s = " in line, line
    assert re.findall(r"(\w+) = ", line.split(" (hint")[0]) == ["s"], line
    assert not (tmp_path / "out").exists()


def test_a_log_prior_that_fails_is_named_at_its_distance_without_the_score(tmp_path):
    """The log-prior reads no s: its failure is named at the distance alone, in a prior with a
    score of its own."""
    text = "name: lp\nscore: 2*s + log_prior\nlog_prior: log(50 - Abs(d))\n"
    res = run_cli_in_process("build", str(write_prior(tmp_path, text)), "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "field 'log_prior': the log-prior is nan at d = " in line, line
    assert re.findall(r"(\w+) = ", line.split(" (hint")[0]) == ["d"], line
