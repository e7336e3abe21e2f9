"""``bamgen.load`` and its cache, from a user's side: a prior by its shipped name, cache entries
damaged by a crash or a full disk, builds killed half-way, a lock held by a stuck build, and
modules that must survive ``torch.save`` and ``torch.multiprocessing.spawn`` in fresh processes.

Every fresh process here starts in a folder other than the repository, as a user's would.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import bamgen
from bamgen.errors import SpecError
from tests.helpers import run_cli, write_prior

# A description with non-ASCII text: the module's bytes then hold multi-byte UTF-8 characters,
# as the shipped generalized_gaussian's do.
PRIOR = """
name: my_laplace
description: Laplace prior — ALiBi with a learnable slope (b ≥ 0)
log_prior: -Abs(d) / b
params:
  b: {init: "2**(8*(h + 1)/H)", domain: positive}
"""


def _env(cache, **extra) -> dict:
    env = dict(os.environ, BAMGEN_CACHE_DIR=str(cache), TRITON_INTERPRET="1", **extra)
    env.pop("PYTHONPATH", None)
    return env


def _run_script(folder, source: str, *args, env: dict, timeout: float = 240):
    """Run ``source`` as a script in a fresh interpreter whose working directory is ``folder``."""
    script = folder / f"script_{abs(hash(source)):x}.py"
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _module_files(cache):
    return sorted(p for p in cache.rglob("*.py"))


def _leftovers(folder):
    """Files a build should never leave behind: temporary files and lock files."""
    return sorted(p.name for p in folder.rglob("*") if p.suffix in (".tmp", ".lock"))


# -- a shipped prior by name ---------------------------------------------------------------------

def test_load_finds_a_shipped_prior_by_the_name_bamgen_list_prints(tmp_path):
    listed = run_cli("list", cwd=tmp_path)
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert "generalized_gaussian" in names
    module = bamgen.load("generalized_gaussian", cache_dir=tmp_path / "cache")
    assert module.PRIOR["name"] == "generalized_gaussian"
    q = torch.randn(1, 2, 5, 8)
    out = module.attention(q, q, q, alpha=2.0, beta=1.0, mu=0.0)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_load_under_a_meta_default_device_builds_and_gives_meta_modules(tmp_path):
    """A model built under ``with torch.device("meta")`` may load its prior there: the build's
    checks still compute on the CPU, and the module made in that context holds meta
    parameters, ready for to_empty() and reset_parameters()."""
    with torch.device("meta"):
        module = bamgen.load("laplace", cache_dir=tmp_path / "cache")
        layer = module.LaplaceAttention(num_heads=4)
    assert layer.raw_b.device.type == "meta"
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.allclose(layer.prior_params()["b"], module.default_params(4)["b"])


def test_every_shipped_file_is_named_after_its_prior():
    from bamgen.resources import shipped_priors
    from bamgen.compiler.spec import load_spec
    for path in shipped_priors():
        assert load_spec(path).name == path.stem   # `bamgen list` prints the name; load looks up the file


def test_an_unknown_name_lists_the_shipped_priors(tmp_path):
    with pytest.raises(SpecError) as err:
        bamgen.load("generalised_gaussian", cache_dir=tmp_path)
    message = str(err.value)
    assert "generalised_gaussian" in message and "generalized_gaussian" in message
    assert "laplace" in message


def test_an_error_found_after_parsing_names_the_file(tmp_path):
    """A formula the domain scan refuses (nan far away) is reported with the file's path, as a
    parse error is, not as '<prior>'."""
    bad = tmp_path / "far_nan.yaml"
    bad.write_text("name: far_nan\nlog_prior: log(10 - Abs(d))\n")
    with pytest.raises(SpecError) as err:
        bamgen.load(bad, cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert message.startswith(str(bad)) and "field 'log_prior'" in message, message


def test_a_file_in_the_current_folder_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_prior(tmp_path, PRIOR.replace("my_laplace", "laplace"), "laplace")
    module = bamgen.load("laplace", cache_dir=tmp_path / "cache")
    assert "learnable slope (b" in module.PRIOR["description"]


def test_cli_builds_a_shipped_prior_by_name(tmp_path):
    res = run_cli("build", "laplace", "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "laplace.py").is_file()


# -- damaged entries, killed builds, held locks ------------------------------------------------

def test_truncated_entry_ending_inside_a_character_is_repaired(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    bamgen.load(prior, cache_dir=cache)
    (target,) = _module_files(cache)
    good = target.read_bytes()
    cut = next(i for i, byte in enumerate(good) if byte >= 0x80) + 1   # inside "—"
    target.write_bytes(good[:cut])
    module = bamgen.load(prior, cache_dir=cache)
    assert target.read_bytes() == good
    assert module.PRIOR["name"] == "my_laplace"


def test_entry_with_a_flipped_byte_is_repaired(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    bamgen.load(prior, cache_dir=cache)
    (target,) = _module_files(cache)
    good = target.read_bytes()
    middle = len(good) // 2
    target.write_bytes(good[:middle] + bytes([good[middle] ^ 0x20]) + good[middle + 1:])
    bamgen.load(prior, cache_dir=cache)
    assert target.read_bytes() == good


def test_unchanged_entry_is_not_rewritten(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    bamgen.load(prior, cache_dir=cache)
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    bamgen.load(prior, cache_dir=cache)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == stamps


def test_cache_entry_name_spells_out_the_specialisation(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    module = bamgen.load(prior, cache_dir=cache, strategy="table")
    (target,) = _module_files(cache)
    folder = target.parent.name
    assert folder.startswith("my_laplace_table_")
    assert folder.endswith(module.PRIOR["build_hash"])
    assert module.__name__ == f"bamgen._cache.{folder}"


def test_one_prior_under_two_file_names_gives_two_stable_entries(tmp_path):
    # The file name is written into the module's header, so it is part of what the hash names.
    first, second = write_prior(tmp_path, PRIOR, "a.yaml"), write_prior(tmp_path, PRIOR, "b.yaml")
    cache = tmp_path / "cache"
    modules = [bamgen.load(path, cache_dir=cache) for path in (first, second)]
    assert modules[0].__name__ != modules[1].__name__
    for module, path in zip(modules, (first, second)):
        assert f"Generated by bamgen {bamgen.__version__} from {path.name}." in \
            Path(module.__file__).read_text(encoding="utf-8")
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    for path in (first, second, first):
        bamgen.load(path, cache_dir=cache)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == stamps


KILL_ON_RENAME = """
    import os, signal, sys
    import bamgen
    real_replace = os.replace
    def killed(src, dst, *args, **kwargs):
        if str(dst).endswith(".py"):              # the module is written, not yet renamed
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)
    os.replace = killed
    if sys.argv[1] == "load":
        bamgen.load(sys.argv[2], cache_dir=sys.argv[3])
    else:
        from bamgen.cli import main
        main(["build", sys.argv[2], "-o", sys.argv[3]])
"""


def test_build_killed_before_the_rename_leaves_nothing_after_the_next_load(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    killed = _run_script(tmp_path, KILL_ON_RENAME, "load", prior, cache, env=_env(cache))
    assert killed.returncode == -9, killed.stderr
    assert any(p.suffix == ".tmp" for p in cache.rglob("*"))   # the kill hit mid-write
    assert not _module_files(cache)
    module = bamgen.load(prior, cache_dir=cache)
    assert module.PRIOR["name"] == "my_laplace"
    assert _leftovers(cache) == []


def test_cli_build_killed_before_the_rename_is_cleaned_by_the_next_build(tmp_path):
    prior, out = write_prior(tmp_path, PRIOR), tmp_path / "out"
    killed = _run_script(tmp_path, KILL_ON_RENAME, "build", prior, out, env=_env(tmp_path / "c"))
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.suffix for p in out.iterdir()) == [".lock", ".tmp"]   # killed mid-write
    res = run_cli("build", str(prior), "-o", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["my_laplace.py"]


KILL_ON_UNLOCK = """
    import os, signal, sys
    real_unlink = os.unlink
    def killed(path, *args, **kwargs):
        if str(path).endswith(".lock"):           # the module is in place, the lock not yet gone
            os.kill(os.getpid(), signal.SIGKILL)
        return real_unlink(path, *args, **kwargs)
    os.unlink = killed
    from bamgen.cli import main
    main(["build", sys.argv[1], "-o", sys.argv[2]])
"""


def test_build_killed_while_releasing_its_lock_is_cleaned_by_the_next_build(tmp_path):
    prior, out = write_prior(tmp_path, PRIOR), tmp_path / "out"
    killed = _run_script(tmp_path, KILL_ON_UNLOCK, prior, out, env=_env(tmp_path / "c"))
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in out.iterdir()) == [".my_laplace.py.lock", "my_laplace.py"]
    res = run_cli("build", str(prior), "-o", str(out), cwd=tmp_path)
    assert res.returncode == 0 and "unchanged" in res.stdout, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["my_laplace.py"]


def test_failed_write_leaves_no_temporary_file_and_keeps_the_old_module(tmp_path):
    prior, out = write_prior(tmp_path, PRIOR), tmp_path / "out"
    assert run_cli("build", str(prior), "-o", str(out)).returncode == 0
    before = (out / "my_laplace.py").read_bytes()
    full_disk = """
        import errno, os, sys
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.replace = full
        from bamgen.cli import main
        main(["build", sys.argv[1], "-o", sys.argv[2]])
    """
    write_prior(tmp_path, PRIOR.replace("b ≥ 0", "b > 0"))
    res = _run_script(tmp_path, full_disk, prior, out, env=_env(tmp_path / "c"))
    assert res.returncode == 2 and "No space left on device" in res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["my_laplace.py"]
    assert (out / "my_laplace.py").read_bytes() == before


STALL_WHILE_WRITING = """
    import os, sys, time
    import bamgen
    marker = sys.argv[3]
    def stalled(src, dst, *args, **kwargs):   # a build stuck mid-write, holding the lock
        open(marker, "w").close()
        time.sleep(600)
    os.replace = stalled
    from bamgen.cli import main
    main(["build", sys.argv[1], "-o", sys.argv[2]])
"""


def test_a_held_lock_times_out_with_a_message_saying_who_holds_it(tmp_path):
    prior, out, marker = write_prior(tmp_path, PRIOR), tmp_path / "out", tmp_path / "stalled"
    env = _env(tmp_path / "c")
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(STALL_WHILE_WRITING), encoding="utf-8")
    holder = subprocess.Popen([sys.executable, str(script), str(prior), str(out), str(marker)],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never started"
            time.sleep(0.1)
        start = time.monotonic()
        res = run_cli("build", str(prior), "-o", str(out), cwd=tmp_path,
                      env={**env, "BAMGEN_LOCK_TIMEOUT": "2"})
        waited = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    message = lines[0]
    assert str(holder.pid) in message                   # who holds it
    assert ".my_laplace.py.lock" in message             # which lock
    assert "BAMGEN_LOCK_TIMEOUT" in message and "delete" in message   # how to clear it
    assert waited < 60
    # the holder is gone (killed): its lock is released with it, and the next build cleans up
    again = run_cli("build", str(prior), "-o", str(out), cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.iterdir()) == ["my_laplace.py"]


def test_load_reports_a_held_lock_as_a_timeout(tmp_path, monkeypatch):
    from bamgen.driver.files import BuildLockTimeout, file_lock
    monkeypatch.setenv("BAMGEN_LOCK_TIMEOUT", "0.5")
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    bamgen.load(prior, cache_dir=cache)
    (target,) = _module_files(cache)
    target.write_bytes(b"# damaged\n")
    with file_lock(target):
        with pytest.raises(BuildLockTimeout, match="BAMGEN_LOCK_TIMEOUT"):
            bamgen.load(prior, cache_dir=cache)
    assert _leftovers(cache) == []


def test_no_lock_files_in_the_temp_folder_and_none_left_beside_the_module(tmp_path):
    prior, out, tmp = write_prior(tmp_path, PRIOR), tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    env = _env(tmp_path / "cache", TMPDIR=str(tmp))
    res = run_cli("build", str(prior), "-o", str(out), cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    loaded = _run_script(tmp_path, "import bamgen, sys\nbamgen.load(sys.argv[1])\n", prior, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert list(tmp.iterdir()) == []
    assert sorted(p.name for p in out.iterdir()) == ["my_laplace.py"]
    assert _leftovers(tmp_path / "cache") == []


# -- pickling and fresh processes ---------------------------------------------------------------

SAVE_MODEL = """
    import sys, torch, bamgen
    module = bamgen.load(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": module.MyLaplaceAttention(num_heads=2),
                                 "proj": torch.nn.Linear(8, 8)})
    with torch.no_grad():
        model["attn"].raw_b.add_(0.25)          # trained values must survive the round trip
    q = torch.randn(1, 2, 6, 8)
    torch.save(model, sys.argv[2])
    torch.save({"q": q, "out": model["attn"](q, q, q)}, sys.argv[3])
    print(type(model["attn"]).__module__)
"""

LOAD_MODEL = """
    import sys, torch
    model = torch.load(sys.argv[1], weights_only=False)
    data = torch.load(sys.argv[2])
    q = data["q"]
    torch.testing.assert_close(model["attn"](q, q, q), data["out"], rtol=0, atol=0)
    print(type(model["attn"]).__module__)
"""


def _save_then_load(tmp_path, prior, cache, damage=None):
    saver, loader = tmp_path / "saver", tmp_path / "loader"
    saver.mkdir(exist_ok=True)
    loader.mkdir(exist_ok=True)
    model, data = tmp_path / "model.pt", tmp_path / "data.pt"
    saved = _run_script(saver, SAVE_MODEL, prior, model, data, env=_env(cache))
    assert saved.returncode == 0, saved.stderr
    if damage:
        damage(cache)
    loaded = _run_script(loader, LOAD_MODEL, model, data, env=_env(cache))
    return saved, loaded


def test_torch_save_of_a_model_holding_a_loaded_module_loads_in_a_fresh_process(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    saved, loaded = _save_then_load(tmp_path, prior, cache)
    assert loaded.returncode == 0, loaded.stderr
    name = saved.stdout.split()[-1]
    assert name.startswith("bamgen._cache.my_laplace_") and loaded.stdout.split()[-1] == name


def test_unpickling_rebuilds_a_damaged_cache_entry(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"

    def truncate(cache):
        (target,) = _module_files(cache)
        target.write_bytes(target.read_bytes()[:1000])

    _, loaded = _save_then_load(tmp_path, prior, cache, damage=truncate)
    assert loaded.returncode == 0, loaded.stderr
    assert _leftovers(cache) == []


def test_unpickling_without_the_cache_entry_says_how_to_get_it_back(tmp_path):
    import shutil
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    _, loaded = _save_then_load(tmp_path, prior, cache, damage=shutil.rmtree)
    assert loaded.returncode != 0
    last = loaded.stderr.strip().splitlines()[-1]
    assert "bamgen._cache.my_laplace_" in last and "BAMGEN_CACHE_DIR" in last
    assert "bamgen.load" in last


def test_unpickling_a_shipped_prior_rebuilds_it_when_the_cache_is_gone(tmp_path):
    import shutil
    script = """
        import sys, torch, bamgen
        attn = bamgen.load("laplace").LaplaceAttention(num_heads=2)
        torch.save(attn, sys.argv[1])
    """
    cache = tmp_path / "cache"
    saved = _run_script(tmp_path, script, tmp_path / "attn.pt", env=_env(cache))
    assert saved.returncode == 0, saved.stderr
    shutil.rmtree(cache)
    loaded = _run_script(tmp_path, "import sys, torch\nprint(torch.load(sys.argv[1], "
                         "weights_only=False))\n", tmp_path / "attn.pt", env=_env(cache))
    assert loaded.returncode == 0, loaded.stderr
    assert "LaplaceAttention" in loaded.stdout


SPAWN = """
    import sys, torch, torch.multiprocessing as mp, bamgen

    def worker(rank, attn, q, expected):
        torch.testing.assert_close(attn(q, q, q), expected, rtol=0, atol=0)

    if __name__ == "__main__":
        attn = bamgen.load(sys.argv[1]).MyLaplaceAttention(num_heads=2)
        q = torch.randn(1, 2, 5, 8)
        with torch.no_grad():
            expected = attn(q, q, q)
        mp.spawn(worker, args=(attn, q, expected), nprocs=1)
        print("spawned ok")
"""


def test_multiprocessing_spawn_passes_a_loaded_module(tmp_path):
    prior, cache = write_prior(tmp_path, PRIOR), tmp_path / "cache"
    res = _run_script(tmp_path, SPAWN, prior, env=_env(cache))
    assert res.returncode == 0, res.stderr
    assert "spawned ok" in res.stdout
