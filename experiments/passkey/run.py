"""Passkey retrieval with bamgen-generated attention: train tiny decoders at a short length,
test them at many times that length (64x by default).

    .venv/bin/python experiments/passkey/run.py              # the whole study -> docs/results/
    .venv/bin/python experiments/passkey/run.py --smoke      # 1 step, tiny eval, a temp dir
    .venv/bin/python experiments/passkey/run.py --report-only

Each (variant, seed) run is saved as runs/<variant>-s<seed>.json under --out; a run whose
file exists with the same settings is reused, so an interrupted study resumes where it
stopped. The report (results.md, accuracy.png, priors.png) is rebuilt from those files.
See experiments/passkey/README.md.
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from studyio import load_json, log, run_jobs, runs_to_do, save_json  # noqa: E402
from model import VARIANTS  # noqa: E402

# The study's variants (its committed results); the Forgetting Transformer ("fox", positions
# from the model: docs/positions.md) runs with --variants fox.
DEFAULT_VARIANTS = [v for v, spec in VARIANTS.items() if not spec.get("forget_gate")]
from task import MIN_LENGTH  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(ROOT, "docs", "results")
# Relative cost of a training step per variant (measured): the longest runs start first.
COST = {"bam_ssmax": 2.0}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. SEEDS-1 per variant")
    ap.add_argument("--steps", type=int, default=500, help="training steps per model")
    ap.add_argument("--batch", type=int, default=64, help="training sequences per step")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    ap.add_argument("--prior-lr-mult", type=float, default=10.0,
                    help="learning-rate multiplier of the prior parameters")
    ap.add_argument("--train-length", type=int, default=64, help="training sequence length")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                    help="evaluation lengths as multiples of --train-length")
    ap.add_argument("--depths", type=int, default=5, help="evenly spread passkey depths, 0 to 1")
    ap.add_argument("--eval-samples", type=int, default=16, help="samples per (length, depth)")
    ap.add_argument("--workers", type=int, default=2, help="processes, one thread each")
    ap.add_argument("--backend", choices=["generated", "materialised"], default="generated",
                    help="attention through the generated module or a materialised bias")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda to run the generated modules' Triton kernels "
                         "(use --workers 1 on one GPU)")
    ap.add_argument("--packed", action="store_true",
                    help="train on packed documents: each of the --batch rows of --train-length "
                         "tokens holds passkey samples of random lengths (a quarter of to the "
                         "full training length), each attending only within itself; needs "
                         "--backend generated; skips the backend comparison")
    ap.add_argument("--timing-steps", type=int, default=None,
                    help="training steps per timing round of the backend comparison (0: skip; "
                         "default 10, or 0 with --packed)")
    ap.add_argument("--timing-rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--smoke", action="store_true",
                    help="1 step, 1 seed, 2 lengths, 2 depths, 2 samples, into a temp dir")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the report from the saved runs, train nothing")
    ap.add_argument("--force", action="store_true", help="retrain runs that already exist")
    args = ap.parse_args(argv)
    _check_packed(ap, args)
    if args.timing_steps is None:
        args.timing_steps = 0 if args.packed else 10
    if args.smoke:
        args.steps, args.seeds, args.lengths, args.depths, args.batch = 1, 1, [1, 2], 2, 8
        args.eval_samples, args.workers, args.timing_rounds = 2, 1, 1
        args.timing_steps = min(args.timing_steps, 1)
        args.out = args.out or tempfile.mkdtemp(prefix="passkey-smoke-")
    args.out = args.out or DEFAULT_OUT
    return args


def _check_packed(ap, args):
    """--packed runs only through the generated modules (they take cu_seqlens); exits with
    status 2 and a message naming the conflicting option otherwise."""
    if not args.packed:
        return
    if args.backend != "generated":
        ap.error("--packed needs --backend generated: the materialised-bias baseline builds "
                 "one [H, N, N] bias per sequence and cannot take packed documents")
    if args.timing_steps:
        ap.error("--packed cannot run the backend comparison (it times the materialised "
                 "baseline, which cannot take packed documents): drop --timing-steps or pass 0")
    if args.train_length < MIN_LENGTH:
        ap.error(f"--train-length must be at least {MIN_LENGTH} tokens (a passkey sample)")


def packed_min_length(train_length):
    """The shortest packed training document: a quarter of the training length, or the
    shortest valid passkey sample if that is longer."""
    return max(MIN_LENGTH, train_length // 4)


def make_config(args):
    """Every setting that changes a run's result (a saved run is reused only if they match)."""
    depths = [round(i / (args.depths - 1), 4) for i in range(args.depths)] if args.depths > 1 else [0.5]
    cfg = dict(steps=args.steps, batch=args.batch, lr=args.lr, prior_lr_mult=args.prior_lr_mult, warmup_frac=0.05,
               weight_decay=0.01, clip=1.0, train_length=args.train_length, d_model=64,
               n_layers=2, n_heads=4, multiples=sorted(args.lengths), depths=depths,
               eval_samples=args.eval_samples, eval_seed=1234, backend=args.backend,
               log_every=max(1, min(50, args.steps // 10)))
    if args.packed:      # only then: runs saved before the option existed keep matching
        cfg.update(packed=True, packed_min_length=packed_min_length(args.train_length))
    return cfg


def run_path(out, variant, seed):
    return os.path.join(out, "runs", f"{variant}-s{seed}.json")


def train_task(variant, seed, cfg, out, device):
    """Worker: one (variant, seed) run, saved as JSON. Returns its path."""
    from train import run_one
    record = run_one(variant, seed, cfg, log=log, device=device)
    path = run_path(out, variant, seed)
    save_json(path, record)
    return path


def timing_task(cfg, variants, steps, rounds, out, device):
    """Worker: the generated-path vs materialised-bias wall-time comparison, saved as JSON."""
    from train import time_backends
    result = dict(config=cfg, steps_per_round=steps, rounds=rounds, device=device,
                  per_variant=time_backends(cfg, variants, steps, rounds, log=log, device=device))
    path = os.path.join(out, "timing.json")
    save_json(path, result)
    return path


def pending_tasks(args, cfg):
    """The (function, args) jobs still to do, the costliest first."""
    jobs = [(train_task, (variant, seed, cfg, args.out, args.device))
            for variant, seed in runs_to_do(args.out, args.variants, args.seeds, cfg, args.force, COST)]
    if args.timing_steps > 0:
        saved = load_json(os.path.join(args.out, "timing.json"))
        if saved and saved.get("config") == cfg and not args.force:
            log("[timing] reusing timing.json")
        else:
            jobs.append((timing_task, (cfg, args.variants, args.timing_steps,
                                       args.timing_rounds, args.out, args.device)))
    return jobs


def main(argv=None):
    args = parse_args(argv)
    cfg = make_config(args)
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        jobs = pending_tasks(args, cfg)
        log(f"passkey study: {len(jobs)} job(s) on {args.workers} process(es) -> {args.out}")
        start = time.perf_counter()
        run_jobs(jobs, args.workers)
        wall = time.perf_counter() - start
        log(f"done in {wall / 60:.1f} min")
        if jobs:
            save_json(os.path.join(args.out, "study.json"),
                      dict(config=cfg, wall_seconds=round(wall, 1), workers=args.workers,
                           load_average_at_end=[round(x, 2) for x in os.getloadavg()],
                           cpus=os.cpu_count(),
                           jobs=len(jobs), argv=sys.argv[1:] if argv is None else list(argv)))
    from report import write_report
    paths = write_report(args.out, variants=args.variants)
    for path in paths:
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
