"""Passkey retrieval at 128x, 256x and 512x the training length: the passkey study's models
(experiments/passkey, same settings and seeds) evaluated with a KV cache and block skipping.

    .venv/bin/python experiments/passkey_long/run.py              # the study -> docs/results/passkey_long/
    .venv/bin/python experiments/passkey_long/run.py --smoke      # seconds, into a temp dir
    .venv/bin/python experiments/passkey_long/run.py --report-only

Models are trained with the passkey study's default settings (so a seed gives the committed
study's model) and kept in checkpoints/; their evaluation goes in rounds: each round adds one
group of samples to every (model, length, depth), and runs/<variant>-s<seed>.json is saved after
every group, so an interrupted study resumes where it stopped and its report covers the rounds
that finished. --groups raises the sample count later without redoing anything. See
experiments/passkey_long/README.md.
"""
import argparse
import importlib.util
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
from studyio import load_json, log, record_session, save_json  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "docs", "results", "passkey_long")
COMMITTED_RUNS = os.path.join(ROOT, "docs", "results", "runs")
EVAL_SEED = 4321            # not the passkey study's 1234: new sequences


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["ggd_nope", "alibi"],
                    choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. SEEDS-1 per variant")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512],
                    help="evaluation lengths as multiples of the training length")
    ap.add_argument("--depths", type=int, default=5, help="evenly spread passkey depths, 0 to 1")
    ap.add_argument("--groups", type=int, default=10,
                    help="rounds: groups of samples per (model, length, depth)")
    ap.add_argument("--group-size", type=int, default=4, help="samples per group (one batch)")
    ap.add_argument("--skip-nats", type=float, default=30.0,
                    help="block skipping: keys whose learned log-prior is this many nats below the "
                         "head's peak are left out (0: no skipping)")
    ap.add_argument("--check-groups", type=int, default=1,
                    help="groups per (model, length) at depth 0 also decoded without skipping")
    ap.add_argument("--reproduce", type=int, nargs="*", default=[64],
                    help="multiples at which each retrained model is scored on the passkey study's "
                         "own samples, to compare with its committed results")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the generated Triton kernels")
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--smoke", action="store_true",
                    help="2 training steps, 1 seed, 2x and 4x, 2 samples, into a temp dir")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the report from the saved runs, evaluate nothing")
    ap.add_argument("--force", action="store_true", help="retrain and re-evaluate everything")
    args = ap.parse_args(argv)
    args.train_overrides = {}
    if args.smoke:
        args.variants = [v for v in args.variants if v in ("ggd_nope", "alibi")] or args.variants[:1]
        args.seeds, args.lengths, args.depths, args.groups, args.group_size = 1, [2, 4], 2, 1, 2
        args.reproduce, args.train_overrides = [2], dict(steps=2, batch=8)
        args.out = args.out or tempfile.mkdtemp(prefix="passkey-long-smoke-")
    args.out = args.out or DEFAULT_OUT
    return args


def passkey_config(overrides):
    """The passkey study's default training settings (experiments/passkey/run.py), which made
    the committed models, with any overrides (the smoke run's)."""
    spec = importlib.util.spec_from_file_location("passkey_run", os.path.join(PASSKEY, "run.py"))
    passkey_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(passkey_run)
    cfg = passkey_run.make_config(passkey_run.parse_args([]))
    cfg.update(overrides)
    return cfg


def eval_config(args):
    """What makes two evaluations comparable (more groups and lengths may be added later)."""
    depths = [round(i / (args.depths - 1), 4) for i in range(args.depths)] if args.depths > 1 else [0.5]
    return dict(depths=depths, group_size=args.group_size, skip_nats=args.skip_nats or None,
                eval_seed=EVAL_SEED, decoding="greedy, KV cache")


def run_path(out, variant, seed):
    return os.path.join(out, "runs", f"{variant}-s{seed}.json")


def checkpoint_path(out, variant, seed):
    return os.path.join(out, "checkpoints", f"{variant}-s{seed}.pt")


def trained_model(variant, seed, cfg, args):
    """The (variant, seed) model: from its checkpoint if one matches cfg, else trained now and
    saved, with its accuracy on the passkey study's own samples at --reproduce. Returns (model,
    checkpoint dict without the weights)."""
    import torch
    from train import build_model, evaluate, train
    path = checkpoint_path(args.out, variant, seed)
    model = build_model(variant, cfg, seed, args.device)
    initial = model.prior_params()
    saved, trained_now = None, False
    if os.path.exists(path) and not args.force:
        saved = torch.load(path, map_location=args.device, weights_only=False)
        if saved.get("config") != cfg:
            saved = None
    if saved is None:
        tag = f"[{variant} s{seed}]"
        curve, seconds = train(model, cfg, seed, log=log, tag=tag)
        reproduce, _ = evaluate(model, dict(cfg, multiples=sorted(args.reproduce)), log=log, tag=tag) \
            if args.reproduce else ({}, {})
        saved = dict(config=cfg, model=model.state_dict(), curve=curve, train_seconds=round(seconds, 1),
                     initial_prior=initial, reproduce=reproduce)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(saved, path + ".tmp")
        os.replace(path + ".tmp", path)
        trained_now = True
    model.load_state_dict(saved["model"])
    model.eval()
    return model, dict({k: v for k, v in saved.items() if k != "model"}, trained_now=trained_now)


def committed_accuracy(variant, seed, cfg, multiples):
    """The committed passkey study's accuracy of this model at these multiples, if it was made
    with the same settings."""
    rec = load_json(os.path.join(COMMITTED_RUNS, f"{variant}-s{seed}.json"))
    if not rec or rec.get("config") != cfg:
        return None
    return {str(m): rec["accuracy"][str(m)] for m in multiples if str(m) in rec["accuracy"]}


def new_record(variant, seed, cfg, ecfg, ckpt, model):
    return dict(variant=variant, label=VARIANTS[variant]["label"], seed=seed, config=cfg,
                eval_config=ecfg, curve=ckpt["curve"], train_seconds=ckpt["train_seconds"],
                reproduce=ckpt["reproduce"], initial_prior=ckpt["initial_prior"],
                learned_prior=model.prior_params(), cells={}, windows={}, work={}, checks={})


def evaluate_cell(model, rec, args, mult, di, depth, group):
    """One group of one (length, depth) cell of one model, stored in rec. Returns seconds or
    None if the group was already done."""
    from inference import QUERY_BLOCK, model_windows
    from long_eval import attention_work, evaluate_group, sample_group
    length = rec["config"]["train_length"] * mult
    cell = rec["cells"].setdefault(str(mult), {}).setdefault(str(depth), dict(groups={}, seconds={}))
    if str(group) in cell["groups"]:
        return None
    if str(mult) not in rec["windows"]:
        windows = model_windows(model, args.skip_nats, length) if args.skip_nats else None
        rec["windows"][str(mult)] = windows
        rec["work"][str(mult)] = attention_work(windows[0] if windows else None, length, QUERY_BLOCK)
    seq, _ = sample_group(length, di, depth, group, args.group_size, EVAL_SEED)
    check = group < args.check_groups and di == 0 and bool(args.skip_nats)
    result = evaluate_group(model, seq, args.skip_nats, check=check)
    cell["groups"][str(group)] = result["correct"]
    cell["seconds"][str(group)] = round(result["seconds"], 3)
    if check:
        rec["checks"].setdefault(str(mult), {})[str(group)] = result["check"]
    return result["seconds"]


def run_study(args):
    """Train or load every model, then evaluate in rounds. Returns the two configurations and
    whether anything was done (a finished study rerun does nothing)."""
    from train import single_thread
    single_thread()
    work = 0
    cfg, ecfg = passkey_config(args.train_overrides), eval_config(args)
    models, records = {}, {}
    for variant in args.variants:
        for seed in range(args.seeds):
            model, ckpt = trained_model(variant, seed, cfg, args)
            work += ckpt.pop("trained_now")
            rec = load_json(run_path(args.out, variant, seed))
            if args.force or not rec or rec.get("config") != cfg or rec.get("eval_config") != ecfg:
                rec = new_record(variant, seed, cfg, ecfg, ckpt, model)
            rec["committed"] = committed_accuracy(variant, seed, cfg, args.reproduce)
            models[(variant, seed)], records[(variant, seed)] = model, rec
            save_json(run_path(args.out, variant, seed), rec)
    for group in range(args.groups):
        for mult in sorted(args.lengths):
            for key, model in models.items():
                rec, spent, right, n = records[key], 0.0, 0, 0
                for di, depth in enumerate(ecfg["depths"]):
                    seconds = evaluate_cell(model, rec, args, mult, di, depth, group)
                    if seconds is not None:
                        spent += seconds
                        right += sum(rec["cells"][str(mult)][str(depth)]["groups"][str(group)])
                        n += args.group_size
                if n:
                    work += 1
                    save_json(run_path(args.out, *key), rec)
                    log(f"[{key[0]} s{key[1]}] {mult}x round {group + 1}/{args.groups}: {right}/{n} "
                        f"right, {spent / n:.2f} s/sample")
    return cfg, ecfg, work > 0


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        log(f"passkey at {', '.join(f'{m}x' for m in args.lengths)}: {len(args.variants)} variant(s) x "
            f"{args.seeds} seed(s), {args.groups} group(s) of {args.group_size} per depth -> {args.out}")
        start = time.perf_counter()
        cfg, ecfg, worked = run_study(args)
        wall = time.perf_counter() - start
        log(f"done in {wall / 60:.1f} min")
        if worked:
            record_session(args.out, dict(train=cfg, eval=ecfg), wall, 1,
                           sys.argv[1:] if argv is None else argv, len(args.variants) * args.seeds)
    from long_report import write_report
    for path in write_report(args.out, variants=args.variants):
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
