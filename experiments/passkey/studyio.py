"""What the studies' command lines share: their JSON records (runs/*.json, study.json, ...),
console progress, and running jobs in this process or a pool of fresh ones."""
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed


def log(msg):
    print(msg, flush=True)


def load_json(path):
    """The JSON document at path, or None if it is missing or unreadable (a run cut off while
    writing leaves no file: save_json writes a temporary file and renames it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def save_json(path, obj):
    """Write obj atomically (temporary file, then rename), creating the folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_jobs(jobs, workers):
    """Run (function, args) jobs, in this process (workers <= 1) or in a pool of fresh
    processes (spawned: one thread each, no forked state); a worker's error is re-raised here."""
    if workers <= 1:
        for fn, fn_args in jobs:
            fn(*fn_args)
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(fn, *fn_args) for fn, fn_args in jobs]
        for fut in as_completed(futures):
            fut.result()


def record_session(out, cfg, wall_seconds, workers, argv, jobs):
    """Append this session's wall time to out/study.json (a resumed study adds up its sessions;
    a study with other settings starts the list anew) and return the document."""
    import datetime
    path = os.path.join(out, "study.json")
    saved = load_json(path)
    sessions = saved["sessions"] if saved and saved.get("config") == cfg and "sessions" in saved else []
    sessions.append(dict(ended=datetime.datetime.now().isoformat(timespec="seconds"),
                         wall_seconds=round(wall_seconds, 1), workers=workers, jobs=jobs,
                         load_average_at_end=[round(x, 2) for x in os.getloadavg()],
                         cpus=os.cpu_count(), argv=list(argv)))
    doc = dict(config=cfg, sessions=sessions, workers=workers,
               wall_seconds=round(sum(s["wall_seconds"] for s in sessions), 1),
               load_average_at_end=sessions[-1]["load_average_at_end"])
    save_json(path, doc)
    return doc


def runs_to_do(out, variants, seeds, cfg, force, cost, complete=lambda record: True):
    """(variant, seed) pairs with no saved runs/<variant>-s<seed>.json of these settings (or
    one that complete(record) finds lacking), the costliest variants first (cost: relative cost
    per variant, 1 if absent); logs the reused."""
    todo = []
    for variant in sorted(variants, key=lambda v: -cost.get(v, 1.0)):
        for seed in range(seeds):
            path = os.path.join(out, "runs", f"{variant}-s{seed}.json")
            saved = load_json(path)
            if saved and saved.get("config") == cfg and complete(saved) and not force:
                log(f"[{variant} s{seed}] reusing {os.path.relpath(path)}")
                continue
            todo.append((variant, seed))
    return todo
