"""A let entry may use only the entries above it (docs/priors.md, "let"): one that uses an entry
below it, or itself, is refused saying so, where the message called the name an unknown symbol
and hinted to declare it under 'params'."""
from __future__ import annotations

from tests.helpers import run_cli_in_process, write_prior


def _refusal(tmp_path, text: str) -> str:
    res = run_cli_in_process("build", str(write_prior(tmp_path, text, "p.yaml")),
                             "-o", str(tmp_path / "out"))
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert not (tmp_path / "out").exists()
    return line


def test_a_let_that_uses_a_later_let_is_told_the_order(tmp_path):
    line = _refusal(tmp_path, "name: p\nlet:\n  a2: r*2\n  r: Abs(d)\nlog_prior: -a2\n")
    assert "p.yaml:3: field 'let.a2': 'r' is a let entry below 'a2'" in line, line
    assert "each may use only those above it" in line and "move 'r' above 'a2'" in line, line
    assert "unknown symbol" not in line and "params" not in line, line


def test_a_let_that_uses_itself_is_told_so(tmp_path):
    line = _refusal(tmp_path, "name: p\nlet:\n  r: r + 1\nlog_prior: -r\n")
    assert "p.yaml:3: field 'let.r': the let entry 'r' refers to itself" in line, line
    assert "unknown symbol" not in line and "params" not in line, line


def test_a_name_nothing_declares_is_still_an_unknown_symbol(tmp_path):
    line = _refusal(tmp_path, "name: p\nlet:\n  a2: q*2\n  r: Abs(d)\nlog_prior: -a2 - r\n")
    assert "field 'let.a2': unknown symbol 'q'" in line, line


def test_lets_in_order_build(tmp_path):
    text = "name: p\nlet:\n  r: Abs(d)\n  a2: r*2\nlog_prior: -a2\n"
    res = run_cli_in_process("build", str(write_prior(tmp_path, text, "p.yaml")),
                             "-o", str(tmp_path / "out"))
    assert res.exit_code == 0, res.stderr
