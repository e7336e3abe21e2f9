"""The build lock and atomic writes under contention: processes that race on one target."""
import multiprocessing
import os
from pathlib import Path

from bamgen.driver.files import file_lock, write_if_different

ROUNDS = 150


def _increment(counter: str, rounds: int) -> None:
    """Read-modify-write a counter under the lock; a lost update means two holders at once."""
    for _ in range(rounds):
        with file_lock(counter):
            value = int(Path(counter).read_text())
            Path(counter).write_text(str(value + 1))


def _write_versions(target: str, versions: list) -> None:
    for text in versions:
        write_if_different(target, text)


def _run(fn, *args, processes=4):
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=fn, args=args) for _ in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0] * processes


def test_the_lock_excludes_although_each_holder_deletes_its_file(tmp_path):
    counter = tmp_path / "counter"
    counter.write_text("0")
    _run(_increment, str(counter), ROUNDS)
    assert int(counter.read_text()) == 4 * ROUNDS
    assert sorted(os.listdir(tmp_path)) == ["counter"]


def test_racing_writers_leave_one_whole_version_and_nothing_else(tmp_path):
    target = tmp_path / "module.py"
    versions = [f"# version {i}\n" + "x = 'ü'\n" * 2000 for i in range(3)] * 20
    _run(_write_versions, str(target), versions)
    assert target.read_text(encoding="utf-8") in set(versions)
    assert sorted(os.listdir(tmp_path)) == ["module.py"]
