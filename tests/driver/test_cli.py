"""The command line: builds, --check, and user errors (exit 2, one line, nothing written)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers import ROOT, run_cli, run_cli_in_process, write_prior

GOOD = """
name: my_prior
log_prior: -Abs(d) / b
params:
  b: {init: 4.0, domain: positive}
"""


def test_build_writes_a_module_then_reports_unchanged(tmp_path):
    prior = write_prior(tmp_path, GOOD)
    out = tmp_path / "out"
    first = run_cli("build", str(prior), "-o", str(out))
    assert first.returncode == 0, first.stderr
    assert "wrote" in first.stdout and (out / "my_prior.py").is_file()
    mtime = os.stat(out / "my_prior.py").st_mtime_ns
    second = run_cli("build", str(prior), "-o", str(out))
    assert second.returncode == 0 and "unchanged" in second.stdout
    assert os.stat(out / "my_prior.py").st_mtime_ns == mtime   # write-if-different


def test_check_mode_flags_stale_and_writes_nothing(tmp_path):
    prior = write_prior(tmp_path, GOOD)
    out = tmp_path / "out"
    missing = run_cli("build", str(prior), "-o", str(out), "--check")
    assert missing.returncode == 1 and "stale" in missing.stderr
    assert not out.exists()
    assert run_cli("build", str(prior), "-o", str(out)).returncode == 0
    assert run_cli("build", str(prior), "-o", str(out), "--check").returncode == 0
    with open(out / "my_prior.py", "a") as module:   # (still bamgen's: its header is kept)
        module.write("# edited\n")
    assert run_cli("build", str(prior), "-o", str(out), "--check").returncode == 1


def test_bad_prior_exits_2_with_one_line_and_leaves_outputs_untouched(tmp_path):
    good = write_prior(tmp_path, GOOD)
    out = tmp_path / "out"
    assert run_cli("build", str(good), "-o", str(out)).returncode == 0
    before = (out / "my_prior.py").read_bytes()
    bad = write_prior(tmp_path, "name: my_prior\nlog_prior: -Abs(d) / bb\n", "bad.yaml")
    res = run_cli("build", str(good), str(bad), "-o", str(out))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.yaml" in lines[0] and "log_prior" in lines[0]
    assert "unknown symbol 'bb'" in lines[0] and "Traceback" not in res.stderr
    assert (out / "my_prior.py").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["my_prior.py"]


def test_code_injection_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    bad = write_prior(tmp_path, f"name: x\nlog_prior: __import__('os').system('touch {marker}')\n")
    res = run_cli("build", str(bad), "-o", str(tmp_path / "out"))
    assert res.returncode == 2 and not marker.exists() and not (tmp_path / "out").exists()


def test_bad_flags_and_missing_files_exit_2(tmp_path):
    assert run_cli("build", "--strategy", "magic", "x.yaml").returncode == 2
    res = run_cli("build", str(tmp_path / "nope.yaml"))
    assert res.returncode == 2 and "nope.yaml" in res.stderr and "Traceback" not in res.stderr
    assert run_cli("build").returncode == 2
    assert run_cli("frobnicate").returncode == 2


def test_a_bad_flag_or_value_is_one_line_naming_it(tmp_path):
    """click's own refusals (a value out of a choice or a range, an unknown option or command)
    printed click's usage block, four lines unlike every other error: now one line naming the
    option and where its help is, exit 2, nothing written. Help and version are unchanged."""
    from bamgen.cli import main
    runner = CliRunner()
    for args, words in [(["build", "--strategy", "magic", "x.yaml", "-o", str(tmp_path / "o")],
                         "'--strategy': 'magic' is not one of 'inline', 'table' (see 'bamgen build --help')"),
                        (["inspect", "--arch", "sm_70", "laplace"], "'--arch': 'sm_70'"),
                        (["show", "laplace", "--heads", "0"], "'--heads': 0 is not in the range"),
                        (["build", "--bogus"], "No such option '--bogus'"),
                        (["frobnicate"], "No such command 'frobnicate' (see 'bamgen --help')")]:
        res = runner.invoke(main, args, prog_name="bamgen")
        assert res.exit_code == 2, (args, res.output)
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], res.stderr
    assert not (tmp_path / "o").exists()
    assert runner.invoke(main, ["--version"]).exit_code == 0
    assert runner.invoke(main, ["build", "--help"], prog_name="bamgen").output.startswith("Usage: bamgen build")
    bare = runner.invoke(main, [])   # the group's help, as click gives it
    assert bare.exit_code == 2 and "Commands:" in bare.output


def test_list_shows_the_shipped_priors():
    res = run_cli("list")
    assert res.returncode == 0
    for name in ("uniform", "laplace", "generalized_gaussian"):
        assert name in res.stdout


def test_a_target_that_is_a_folder_is_refused_before_anything_is_written(tmp_path):
    """Two priors into one folder where the second's module path is a folder: exit 2 and the
    first's module, built earlier, keeps its bytes (it was written before the failing write)."""
    first = write_prior(tmp_path, GOOD)
    out = tmp_path / "out"
    assert run_cli("build", str(first), "-o", str(out)).returncode == 0
    before = (out / "my_prior.py").read_bytes()
    changed = write_prior(tmp_path, GOOD.replace("4.0", "3.0"), "changed.yaml")
    other = write_prior(tmp_path, GOOD.replace("my_prior", "other"), "other.yaml")
    (out / "other.py").mkdir()
    res = run_cli("build", str(changed), str(other), "-o", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "other.py" in lines[0] and "not a regular file" in lines[0]
    assert (out / "my_prior.py").read_bytes() == before
    assert "wrote" not in res.stdout


def test_a_file_bamgen_did_not_generate_is_never_replaced(tmp_path):
    """`bamgen build my_prior.yaml -o mypkg` replaced mypkg/my_prior.py whatever it held: a
    hand-written module of the user's package that has the prior's name (utils.py, layers.py)
    was lost without a word. Now: exit 2, one line naming it and how to fix it, nothing written
    (not even the other prior's module); a module bamgen generated is still replaced."""
    out = tmp_path / "mypkg"
    other = write_prior(tmp_path, GOOD.replace("my_prior", "other"), "other.yaml")
    assert run_cli("build", str(other), "-o", str(out)).returncode == 0
    users = b"def helper():\n    return 1\n"
    (out / "my_prior.py").write_bytes(users)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    changed = write_prior(tmp_path, GOOD.replace("my_prior", "other").replace("4.0", "3.0"),
                          "changed.yaml")
    mine = write_prior(tmp_path, GOOD)
    res = run_cli("build", str(changed), str(mine), "-o", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{out / 'my_prior.py'}: exists and bamgen did not generate it" \
        in lines[0], res.stderr
    assert "name:" in lines[0] and "--out" in lines[0] and "nothing was written" in lines[0]
    assert "wrote" not in res.stdout
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    res = run_cli("build", str(changed), "-o", str(out))   # bamgen's own module: replaced
    assert res.returncode == 0 and f"wrote {out / 'other.py'}" in res.stdout, res.stderr
    assert (out / "my_prior.py").read_bytes() == users


def _wait_for_torch_import(process: subprocess.Popen, seconds: float = 60.0) -> None:
    """Wait until ``process`` has torch's library mapped: it is then inside `import torch`,
    which goes on for a second or more after the library is loaded."""
    maps = Path(f"/proc/{process.pid}/maps")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if "libtorch" in maps.read_text(errors="replace"):
            return
        time.sleep(0.005)
    raise AssertionError("the command never imported torch")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_ctrl_c_while_importing_torch_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C in the seconds `bamgen build` spends importing torch printed torch's import
    traceback (forty lines, exit 1): the heavy imports ran when bamgen.cli was imported, before
    the command line could handle anything. Now: 'interrupted', exit 130, nothing written."""
    prior = write_prior(tmp_path, GOOD)
    for attempt in range(5):
        out = tmp_path / f"out{attempt}"
        process = subprocess.Popen([sys.executable, "-m", "bamgen.cli", "build", str(prior), "-o",
                                    str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_torch_import(process)
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
        if process.returncode == 0 and stderr == "" and out.exists():
            continue   # (a loaded machine: the build was done before the signal left; again)
        assert process.returncode == 130, stderr
        assert stderr == "interrupted\n" and stdout == ""
        assert not out.exists()
        return
    pytest.fail("every build finished before its Ctrl-C: the machine is too loaded to test it")


def test_ctrl_c_while_writing_leaves_the_old_module_whole(tmp_path, monkeypatch):
    """Ctrl-C at the worst moment of a build, its new module written to a temporary file and
    not yet renamed over the old one: 'interrupted', exit 130 (not click's 'Aborted!', exit 1),
    the old module's bytes, and no temporary or lock file left beside it."""
    import bamgen.driver.files as files
    prior = write_prior(tmp_path, GOOD)
    out = tmp_path / "out"
    assert run_cli_in_process("build", str(prior), "-o", str(out)).exit_code == 0
    before = (out / "my_prior.py").read_bytes()

    def ctrl_c(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(files.os, "fsync", ctrl_c)
    write_prior(tmp_path, GOOD.replace("4.0", "3.0"))
    res = run_cli_in_process("build", str(prior), "-o", str(out))
    assert res.exit_code == 130 and res.stderr == "interrupted\n" and res.stdout == ""
    assert (out / "my_prior.py").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["my_prior.py"]


def test_a_folder_named_as_a_shipped_prior_does_not_shadow_it(tmp_path):
    """`bamgen build laplace` in a folder holding a folder `laplace` (a checkout, an experiment's
    outputs) was refused as 'not a regular file (a folder)': the folder shadowed the shipped
    prior. A folder is never a prior file, so the name is the shipped prior in every command;
    a file of that name is still the user's file."""
    (tmp_path / "laplace").mkdir()
    (tmp_path / "uniform").mkdir()
    res = run_cli_in_process("build", "laplace", "-o", "out", cwd=tmp_path)
    assert res.exit_code == 0 and (tmp_path / "out" / "laplace.py").is_file(), res.output
    res = run_cli_in_process("show", "laplace", "--heads", "2", cwd=tmp_path)
    assert res.exit_code == 0 and res.stdout.startswith("prior 'laplace'"), res.output
    res = run_cli_in_process("plot", "laplace", "-o", "laplace.svg", "--heads", "2", cwd=tmp_path)
    assert res.exit_code == 0 and (tmp_path / "laplace.svg").is_file(), res.output
    res = run_cli("inspect", "uniform", "--head-dim", "16", "--kernel", "attn_fwd", cwd=tmp_path)
    assert res.returncode == 0 and "uniform: sm_90" in res.stdout, res.stderr
    write_prior(tmp_path, GOOD, "cauchy")   # a file: the user's, whatever its name
    res = run_cli_in_process("build", "cauchy", "-o", "out", cwd=tmp_path)
    assert res.exit_code == 0 and (tmp_path / "out" / "my_prior.py").is_file(), res.output
    assert not (tmp_path / "out" / "cauchy.py").exists()
    (tmp_path / "mine").mkdir()   # a folder that names no shipped prior: refused as a folder
    res = run_cli_in_process("show", "mine", cwd=tmp_path)
    assert res.exit_code == 2 and res.stderr == ("error: mine: not a regular file (a folder) "
                                                 "(hint: give the path of a prior file (.yaml))\n")


def test_an_import_that_ctrl_c_cut_short_is_reported_as_the_interrupt(tmp_path, monkeypatch):
    """Ctrl-C in the middle of numpy's import, and the retry fails with ImportError ('cannot
    load module more than once per process') raised while handling the KeyboardInterrupt: it
    printed that traceback, exit 1, about one time in four. An error whose context is a
    Ctrl-C is the interrupt: 'interrupted', exit 130, nothing written."""
    import bamgen.compiler.spec as spec

    def cut_short(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("cannot load module more than once per process")
    monkeypatch.setattr(spec, "load_spec", cut_short)
    out = tmp_path / "out"
    res = run_cli_in_process("build", str(write_prior(tmp_path, GOOD)), "-o", str(out))
    assert res.exit_code == 130 and res.stderr == "interrupted\n" and res.stdout == ""
    assert not out.exists()


def _refused(res, *words: str) -> str:
    """The one line of a refusal (exit 2, no traceback) that holds every one of words."""
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("check", [[], ["--check"]])
def test_an_out_folder_whose_name_is_too_long_is_one_line(tmp_path, check):
    """A 300-byte --out name raised OSError (File name too long) from Path.exists(): a
    traceback and exit 1."""
    write_prior(tmp_path, GOOD)
    res = run_cli_in_process("build", "prior.yaml", "-o", "b" * 300, *check, cwd=tmp_path)
    _refused(res, "--out", "too long", "shorter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prior.yaml"]


def test_inspect_of_a_py_whose_name_is_too_long_is_one_line(tmp_path):
    # (in a process of its own: inspect unsets TRITON_INTERPRET, which this worker needs)
    res = run_cli("inspect", "b" * 300 + ".py", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "FILE" in lines[0] and "too long" in lines[0], res.stderr


def test_inspect_in_process_leaves_triton_interpret_as_it_found_it(tmp_path, monkeypatch):
    """inspect compiles for the GPU, so it unsets TRITON_INTERPRET; called in-process (a test,
    a notebook's CliRunner) it left it unset, and later Triton calls of that process went to
    CUDA. It puts it back when the command ends, refused or not."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = run_cli_in_process("inspect", "b" * 300 + ".py", cwd=tmp_path)
    assert res.exit_code == 2 and "too long" in res.output
    assert os.environ.get("TRITON_INTERPRET") == "1"


def test_out_paths_that_cannot_be_a_folder_are_refused_saying_why(tmp_path):
    """-o '' wrote into the current folder; a dangling link said 'File exists'; a path through
    a file said 'Not a directory' with no hint. Each is now one line, and nothing is written."""
    write_prior(tmp_path, GOOD)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "link").symlink_to("nowhere")
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = {"": ["--out is empty", "--out ."], "link": ["--out link", "link to nowhere",
                                                           "does not exist"],
             "afile/sub": ["--out afile/sub", "a part of the path is a file"]}
    for out, words in cases.items():
        _refused(run_cli_in_process("build", "prior.yaml", "-o", out, cwd=tmp_path), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_control_character_in_an_out_path_is_shown_escaped(tmp_path):
    """A newline in --out split the success line in two."""
    write_prior(tmp_path, GOOD)
    res = run_cli_in_process("build", "prior.yaml", "-o", "n\nl", cwd=tmp_path)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines() == ["wrote n\\nl/my_prior.py"]
    assert (tmp_path / "n\nl" / "my_prior.py").is_file()


def test_check_on_a_file_bamgen_did_not_generate_is_refused_as_build_refuses_it(tmp_path):
    """--check called a user's own module 'stale (run bamgen build)', exit 1, and the build it
    pointed to then refused it: --check now gives the build's refusal, exit 2."""
    write_prior(tmp_path, GOOD)
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "my_prior.py").write_text("# mine\n")
    build = _refused(run_cli_in_process("build", "prior.yaml", "-o", "gen", cwd=tmp_path))
    check = _refused(run_cli_in_process("build", "prior.yaml", "-o", "gen", "--check",
                                        cwd=tmp_path), "bamgen did not generate it")
    assert check == build
    assert (tmp_path / "gen" / "my_prior.py").read_text() == "# mine\n"


@pytest.mark.parametrize("init, words", [
    ("log(200 - H)", ["--heads 250", "the init of b cannot be computed for head 0 of 250"]),
    ("150 - H", ["--heads 250", "b must be positive (> 0)", "got -100.0 for head 0"])])
def test_show_for_more_heads_than_the_build_checks_refuses_what_the_module_refuses(
        tmp_path, init, words):
    """The build checks inits up to 128 heads; `show --heads 250` printed b=nan for every head
    and exited 0, where the module built for 250 heads refuses its inits."""
    write_prior(tmp_path, f"name: x\nlog_prior: -Abs(d)/b\nparams:\n  b: {{init: '{init}', "
                          f"domain: positive}}\n")
    _refused(run_cli_in_process("show", "prior.yaml", "--heads", "250", cwd=tmp_path), *words)
    assert run_cli_in_process("show", "prior.yaml", "--heads", "120", cwd=tmp_path).exit_code == 0


def test_a_cache_folder_that_is_a_file_is_a_user_error_naming_the_variable(tmp_path):
    """BAMGEN_CACHE_DIR naming a file was 'internal error ... please report it'."""
    (tmp_path / "afile").write_text("x")
    env = {**os.environ, "BAMGEN_CACHE_DIR": str(tmp_path / "afile")}
    res = run_cli("inspect", "laplace", env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip()
    assert "BAMGEN_CACHE_DIR" in line and "internal error" not in line and "\n" not in line


def test_a_file_given_twice_is_named_as_given_twice(tmp_path):
    """`build okp.yaml okp.yaml` said 'okp.yaml and okp.yaml both define the prior'."""
    write_prior(tmp_path, GOOD)
    write_prior(tmp_path, GOOD, "copy.yaml")
    for twice in (["prior.yaml", "prior.yaml"], ["prior.yaml", "./prior.yaml"]):
        _refused(run_cli_in_process("build", *twice, "-o", "out", cwd=tmp_path),
                 "is given twice", "once")
    _refused(run_cli_in_process("build", "prior.yaml", "copy.yaml", "-o", "out", cwd=tmp_path),
             "copy.yaml and prior.yaml both define the prior 'my_prior'")
    assert not (tmp_path / "out").exists()


def test_plot_to_a_name_without_an_extension_names_the_extensions(tmp_path):
    """It said 'no extension names no image format'."""
    pytest.importorskip("matplotlib")
    line = _refused(run_cli_in_process("plot", "laplace", "-o", "pfile", cwd=tmp_path),
                    "--out pfile", "no extension", ".png", ".svg")
    assert "names no image format" not in line
    assert not (tmp_path / "pfile").exists()


def test_plot_of_a_two_channel_prior_labels_the_channel_it_draws(tmp_path):
    """alibi_2d's plot draws d0 with d1 = 0, and its axis said 'd = i - j'. (matplotlib's SVG
    keeps each text as a comment beside its glyphs.)"""
    pytest.importorskip("matplotlib")
    res = run_cli_in_process("plot", "alibi_2d", "-o", "p.svg", cwd=tmp_path)
    assert res.exit_code == 0, res.stderr
    svg = (tmp_path / "p.svg").read_text()
    assert "<!-- d0 = i0 - j0 (with d1 = 0) -->" in svg and "d = i - j" not in svg


def test_plot_into_a_path_through_a_file_says_so(tmp_path):
    """It said 'cannot write afile/x.png: File exists'."""
    pytest.importorskip("matplotlib")
    (tmp_path / "afile").write_text("x")
    _refused(run_cli_in_process("plot", "laplace", "-o", "afile/x.png", cwd=tmp_path),
             "afile/x.png", "a part of the path is a file")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_prior_name_too_long_for_the_file_system_is_one_line(tmp_path):
    """`bamgen show aaa...` (300 letters, a shipped prior's name in form) was 'internal error
    ... please report it'."""
    line = _refused(run_cli_in_process("show", "a" * 300, cwd=tmp_path), "File name too long")
    assert "internal error" not in line
