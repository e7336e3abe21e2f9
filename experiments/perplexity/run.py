"""Perplexity on real text: byte-level language models on the Python standard library's source,
trained at a short length and scored by held-out bits per byte at 1x to 64x that length.

    .venv/bin/python experiments/perplexity/run.py               # the study -> docs/results/perplexity/
    .venv/bin/python experiments/perplexity/run.py --smoke       # seconds, into a temp dir
    .venv/bin/python experiments/perplexity/run.py --report-only

Each (variant, seed) run ends as runs/<variant>-s<seed>.json under --out and is reused when
the settings and the corpus match. While a run trains and evaluates, its state (model,
optimiser, finished evaluations) is kept in checkpoints/<variant>-s<seed>.pt every
--checkpoint-every steps and after each evaluation length, so an interrupted study loses
little. See experiments/perplexity/README.md.
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PASSKEY = os.path.join(ROOT, "experiments", "passkey")
for path in (HERE, PASSKEY):
    if path not in sys.path:
        sys.path.insert(0, path)

from model import VARIANTS  # noqa: E402
from studyio import log, record_session, run_jobs, runs_to_do, save_json  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "docs", "results", "perplexity")
DEFAULT_VARIANTS = ["nope", "rope", "alibi", "ggd_nope", "bam_ssmax"]
COST = {"bam_ssmax": 2.5}       # relative cost per step: the longest runs start first


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. SEEDS-1 per variant")
    ap.add_argument("--steps", type=int, default=600, help="training steps per model")
    ap.add_argument("--batch", type=int, default=32, help="training windows per step")
    ap.add_argument("--train-length", type=int, default=128, help="training window in bytes")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    ap.add_argument("--prior-lr-mult", type=float, default=10.0,
                    help="learning-rate multiplier of the prior parameters")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                    help="evaluation chunk lengths as multiples of --train-length")
    ap.add_argument("--eval-bytes", type=int, default=1 << 17,
                    help="held-out bytes scored at every length (a multiple of the longest chunk)")
    ap.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    ap.add_argument("--workers", type=int, default=1, help="processes, one thread each")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the generated Triton kernels")
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--smoke", action="store_true",
                    help="2 steps, 1 seed, lengths 1x and 2x on a few files, into a temp dir")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the report from the saved runs, train nothing")
    ap.add_argument("--force", action="store_true", help="redo runs that already exist")
    args = ap.parse_args(argv)
    args.max_files = None
    if args.smoke:
        args.steps, args.seeds, args.batch, args.train_length, args.lengths = 2, 1, 4, 32, [1, 2]
        args.eval_bytes, args.checkpoint_every, args.max_files = 512, 1, 3
        args.out = args.out or tempfile.mkdtemp(prefix="perplexity-smoke-")
    args.out = args.out or DEFAULT_OUT
    longest = args.train_length * max(args.lengths)
    if args.eval_bytes % longest:
        ap.error(f"--eval-bytes ({args.eval_bytes}) must be a multiple of the longest chunk "
                 f"({longest} = --train-length x the largest of --lengths): it is scored as "
                 f"pieces of that length spread over the held-out files")
    return args


def make_config(args, corpus_info):
    """Every setting that changes a run's result (a saved run is reused only if they match)."""
    return dict(steps=args.steps, batch=args.batch, lr=args.lr, prior_lr_mult=args.prior_lr_mult,
                warmup_frac=0.05, weight_decay=0.01, clip=1.0, train_length=args.train_length,
                d_model=64, n_layers=2, n_heads=4, multiples=sorted(args.lengths),
                eval_bytes=args.eval_bytes, evaluation="chunked (non-overlapping, BOS-initial), evenly spaced pieces",
                corpus=dict(python=corpus_info["python"], train_sha256=corpus_info["train_sha256"],
                            held_out_sha256=corpus_info["held_out_sha256"]),
                checkpoint_every=args.checkpoint_every,
                log_every=max(1, min(50, args.steps // 10)))


def run_path(out, variant, seed):
    return os.path.join(out, "runs", f"{variant}-s{seed}.json")


def checkpoint_path(out, variant, seed):
    return os.path.join(out, "checkpoints", f"{variant}-s{seed}.pt")


def save_checkpoint(path, cfg, model, opt, state):
    """The run so far (model, optimiser, steps done, curve, finished evaluations), atomically."""
    import torch
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(config=cfg, model=model.state_dict(), optimizer=opt.state_dict(), state=state),
               path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, cfg, model, opt, device):
    """The saved state of the run if its checkpoint matches cfg (model and optimiser loaded),
    else a fresh state."""
    import torch
    if os.path.exists(path):
        saved = torch.load(path, map_location=device, weights_only=False)
        if saved.get("config") == cfg:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            return saved["state"]
    return dict(step=0, curve=[], train_seconds=0.0, eval={})


def evaluated(evals, mult, multiples):
    """Whether length `mult` is evaluated. The shortest length also needs by_piece_position
    (the reference for the context gain in the report; runs saved before it was recorded redo
    that one cheap length)."""
    entry = evals.get(str(mult))
    return bool(entry) and (mult != min(multiples) or "by_piece_position" in entry)


def complete(record):
    multiples = record["config"]["multiples"]
    return all(evaluated(record.get("eval", {}), m, multiples) for m in multiples)


def run_task(variant, seed, cfg, out, device, max_files):
    """Worker: one (variant, seed) run, resumed from its checkpoint if one matches cfg."""
    import torch
    from corpus import eval_pieces, files_touched, load_corpus
    from lm import build_model, evaluate_length, train
    from train import make_optimizer, single_thread
    single_thread()
    tag = f"[{variant} s{seed}]"
    corpus = load_corpus(max_files=max_files)
    piece = cfg["train_length"] * max(cfg["multiples"])
    pieces = eval_pieces(corpus["held_out"], cfg["eval_bytes"], piece)
    model = build_model(variant, cfg, seed, device)
    initial = model.prior_params()
    opt = make_optimizer(model, cfg)
    ckpt = checkpoint_path(out, variant, seed)
    state = load_checkpoint(ckpt, cfg, model, opt, device)
    if state["step"] or state["eval"]:
        log(f"{tag} resuming at step {state['step']}, {len(state['eval'])} length(s) evaluated")
    if state["step"] < cfg["steps"]:
        curve_before, seconds_before, t0 = list(state["curve"]), state["train_seconds"], time.perf_counter()

        def checkpoint(step, optimizer, curve):
            state.update(step=step, curve=curve_before + curve,
                         train_seconds=round(seconds_before + time.perf_counter() - t0, 1))
            save_checkpoint(ckpt, cfg, model, optimizer, state)

        curve = train(model, cfg, seed, corpus["train"], log=log, tag=tag, start_step=state["step"],
                      opt=opt, on_checkpoint=checkpoint, seconds_before=seconds_before)
        checkpoint(cfg["steps"], opt, curve)
    for mult in cfg["multiples"]:
        if evaluated(state["eval"], mult, cfg["multiples"]):
            continue
        state["eval"][str(mult)] = result = evaluate_length(model, pieces, cfg, mult)
        log(f"{tag} eval {mult:>3}x ({cfg['train_length'] * mult:>5} bytes/chunk)  held-out bits/byte "
            f"{result['bits_per_byte']:.4f}  {result['seconds']:6.1f} s")
        save_checkpoint(ckpt, cfg, model, opt, state)
    record = dict(variant=variant, label=VARIANTS[variant]["label"], seed=seed, config=cfg,
                  corpus=dict(corpus["info"], eval_pieces=pieces.shape[0], eval_piece_bytes=piece,
                              eval_files=files_touched(corpus["held_out"], cfg["eval_bytes"], piece)),
                  curve=state["curve"], train_seconds=state["train_seconds"],
                  eval=state["eval"], initial_prior=initial, learned_prior=model.prior_params(),
                  device=str(device), torch=torch.__version__)
    save_json(run_path(out, variant, seed), record)
    return record


def pending_tasks(args, cfg):
    """The (function, args) jobs still to do (--force: from scratch), seed by seed, so that a
    study cut short has every variant at its first seeds; the costliest variant first in each."""
    jobs = []
    todo = runs_to_do(args.out, args.variants, args.seeds, cfg, args.force, COST, complete)
    for variant, seed in sorted(todo, key=lambda vs: (vs[1], -COST.get(vs[0], 1.0))):
        if args.force and os.path.exists(checkpoint_path(args.out, variant, seed)):
            os.remove(checkpoint_path(args.out, variant, seed))
        jobs.append((run_task, (variant, seed, cfg, args.out, args.device, args.max_files)))
    return jobs


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        from corpus import load_corpus
        info = load_corpus(max_files=args.max_files)["info"]
        cfg = make_config(args, info)
        jobs = pending_tasks(args, cfg)
        log(f"perplexity study: Python {info['python']} stdlib, {info['train_bytes']} train / "
            f"{info['held_out_bytes']} held-out bytes; {len(jobs)} run(s) on {args.workers} "
            f"process(es) -> {args.out}")
        start = time.perf_counter()
        run_jobs(jobs, args.workers)
        wall = time.perf_counter() - start
        log(f"done in {wall / 60:.1f} min")
        if jobs:
            record_session(args.out, cfg, wall, args.workers,
                           sys.argv[1:] if argv is None else argv, len(jobs))
    from lm_report import write_report
    for path in write_report(args.out, variants=args.variants):
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
