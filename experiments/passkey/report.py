"""The study's report, rebuilt from the saved runs: results.md, accuracy.png, priors.png.

Nothing here trains; `run.py --report-only` calls write_report on an existing output folder.
"""
import glob
import json
import math
import os
import statistics

import torch

from model import MATERIALISED_BIAS, VARIANTS

HEADLINE_MULTIPLES = (16, 32, 64)     # where GGD is compared with ALiBi
GGD_VARIANTS = ("ggd_alibi", "ggd_nope", "bam_ssmax")
POSITIONLESS = ("nope", "rope")


# ----------------------------------------------------------------------------------------
# Loading and aggregation
# ----------------------------------------------------------------------------------------
def load_runs(out, variants=None):
    """{variant: {seed: record}} in the study's variant order."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
        with open(path) as f:
            rec = json.load(f)
        runs.setdefault(rec["variant"], {})[rec["seed"]] = rec
    order = [v for v in VARIANTS if v in runs and (variants is None or v in variants)]
    return {v: dict(sorted(runs[v].items())) for v in order}


def _load_optional(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def mean_over_depths(rec, mult):
    cell = rec["accuracy"][str(mult)]
    return sum(cell.values()) / len(cell)


def seed_accuracies(seeds, mult):
    """Per-seed accuracy (mean over depths) at one length multiple."""
    return [mean_over_depths(rec, mult) for rec in seeds.values()]


def mean_std(xs):
    """Mean and sample standard deviation (0 for a single seed)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt_ms(xs):
    m, s = mean_std(xs)
    return f"{m:.2f} ± {s:.2f}"


def label(variant):
    return VARIANTS[variant]["label"]


# ----------------------------------------------------------------------------------------
# Markdown sections
# ----------------------------------------------------------------------------------------
def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def accuracy_table(runs, multiples):
    header = ["variant", "seeds"] + [f"{m}x" for m in multiples]
    rows = [[label(v), len(seeds)] + [fmt_ms(seed_accuracies(seeds, m)) for m in multiples]
            for v, seeds in runs.items()]
    return _table(header, rows)


def per_seed_table(runs, multiples):
    header = ["variant", "seed"] + [f"{m}x" for m in multiples]
    rows = [[label(v), seed] + [f"{mean_over_depths(rec, m):.2f}" for m in multiples]
            for v, seeds in runs.items() for seed, rec in seeds.items()]
    return _table(header, rows)


def depth_tables(runs, multiples, depths):
    """One table per variant: rows depth, columns multiple, mean over seeds."""
    parts = []
    for v, seeds in runs.items():
        rows = [[f"{float(d):.2f}"] + [
            f"{statistics.fmean(rec['accuracy'][str(m)][str(d)] for rec in seeds.values()):.2f}"
            for m in multiples] for d in depths]
        parts.append(f"**{label(v)}** (mean of {len(seeds)} seed(s))\n\n"
                     + _table(["depth"] + [f"{m}x" for m in multiples], rows))
    return "\n\n".join(parts)


def headline(runs, multiples):
    """The claims the study is about, stated from the numbers (whichever way they go)."""
    lines = []
    if "alibi" in runs:
        at = [m for m in HEADLINE_MULTIPLES if m in multiples]
        for v in GGD_VARIANTS:
            if v not in runs or not at:
                continue
            cells, wins = [], 0
            for m in at:
                g, a = mean_std(seed_accuracies(runs[v], m)), mean_std(seed_accuracies(runs["alibi"], m))
                wins += g[0] > a[0]
                cells.append(f"{m}x: {g[0]:.2f} ± {g[1]:.2f} vs {a[0]:.2f} ± {a[1]:.2f}")
            verdict = (f"Mean above ALiBi's at all {len(at)} lengths" if wins == len(at) else
                       f"Mean above ALiBi's at {wins} of {len(at)} lengths")
            last = seed_accuracies(runs[v], at[-1])
            lines.append(f"- **{label(v)}** vs ALiBi (mean ± std over seeds) — "
                         + "; ".join(cells) + f". {verdict}; its seeds at {at[-1]}x range "
                         f"{min(last):.2f} to {max(last):.2f}.")
    beyond = [m for m in multiples if m > 4]
    for v in POSITIONLESS:
        if v in runs and beyond:
            best = max(beyond, key=lambda m: statistics.fmean(seed_accuracies(runs[v], m)))
            lines.append(f"- **{label(v)}** beyond 4x: at most "
                         f"{statistics.fmean(seed_accuracies(runs[v], best)):.2f} "
                         f"(at {best}x); at 1x {fmt_ms(seed_accuracies(runs[v], 1)) if 1 in multiples else '-'}.")
    return "\n".join(lines)


def training_table(runs):
    header = ["variant", "train s / model", "final loss", "final train answer acc",
              "eval s / model"]
    rows = []
    for v, seeds in runs.items():
        recs = list(seeds.values())
        rows.append([label(v),
                     f"{statistics.fmean(r['train_seconds'] for r in recs):.0f}",
                     fmt_ms([r["curve"][-1]["loss"] for r in recs]),
                     fmt_ms([r["curve"][-1]["answer_acc"] for r in recs]),
                     f"{statistics.fmean(sum(r['eval_seconds'].values()) for r in recs):.0f}"])
    return _table(header, rows)


def params_tables(runs):
    """Prior parameters per seed, layer and head: learned, and the start they learned from."""
    parts = []
    for v, seeds in runs.items():
        first = next(iter(seeds.values()))
        if not any(first["learned_prior"].values()):      # NoPE, RoPE: no prior parameters
            continue
        heads = len(next(iter(first["learned_prior"]["0"].values())))
        rows = []
        init = first["initial_prior"]
        for layer, params in init.items():
            rows.append(["init", layer] + [_param_cell(params, h) for h in range(heads)])
        for seed, rec in seeds.items():
            for layer, params in rec["learned_prior"].items():
                rows.append([seed, layer] + [_param_cell(params, h) for h in range(heads)])
        parts.append(f"**{label(v)}**\n\n" + _table(["seed", "layer"] + [f"head {h}" for h in range(heads)], rows))
    return "\n\n".join(parts)


def _param_cell(params, h):
    return ", ".join(f"{name} {vals[h]:.3g}" for name, vals in params.items() if name != "tm"
                     or any(abs(x) > 0 for x in vals))


def timing_section(timing, runs, study):
    """Generated path vs materialised bias: per step, per evaluation sample and for the study."""
    if not timing:
        return "_No timing run (run without `--timing-steps 0`)._"
    cfg = timing["config"]
    mults = cfg["multiples"]
    rows = []
    for v, t in timing["per_variant"].items():
        g, m = t["generated"], t["materialised"]
        rows.append([label(v), f"{g['train_step'] * 1e3:.0f}", f"{m['train_step'] * 1e3:.0f}",
                     f"{m['train_step'] / g['train_step']:.2f}"]
                    + [f"{g['eval_sample'][str(x)] * 1e3:.0f} / {m['eval_sample'][str(x)] * 1e3:.0f}"
                       for x in mults])
    header = (["variant", "train step ms (generated)", "train step ms (materialised)",
               "materialised / generated"]
              + [f"eval ms/sample {x}x (gen / mat)" for x in mults])
    text = [_table(header, rows)]
    est = estimate_study(timing, runs or {v: {0: None} for v in timing["per_variant"]}, cfg)
    if est:
        g_s, m_s, train_g, train_m, eval_g, eval_m = est
        workers = (study or {}).get("workers", 2)
        text.append(
            f"\nEstimated study time from these rates (every run's training steps and evaluation "
            f"samples, divided over {workers} processes): **generated {g_s / workers / 60:.1f} min, "
            f"materialised {m_s / workers / 60:.1f} min, ratio materialised / generated "
            f"{m_s / g_s:.2f}**. Training alone: {train_g / workers / 60:.1f} vs "
            f"{train_m / workers / 60:.1f} min ({train_m / train_g:.2f}x); evaluation alone: "
            f"{eval_g / workers / 60:.1f} vs {eval_m / workers / 60:.1f} min ({eval_m / eval_g:.2f}x).")
    return "\n".join(text)


def estimate_study(timing, runs, cfg):
    """Process-seconds of the study for each backend: (gen, mat, train gen, train mat, eval gen,
    eval mat). Each run costs steps x step time + its evaluation samples x time per sample."""
    per = timing["per_variant"]
    if not all(v in per for v in runs):
        return None
    n_eval = len(cfg["depths"]) * cfg["eval_samples"]
    tot = {b: [0.0, 0.0] for b in ("generated", "materialised")}
    for v, seeds in runs.items():
        for b in tot:
            tot[b][0] += len(seeds) * cfg["steps"] * per[v][b]["train_step"]
            tot[b][1] += len(seeds) * n_eval * sum(per[v][b]["eval_sample"][str(m)]
                                                   for m in cfg["multiples"])
    g, m = tot["generated"], tot["materialised"]
    return sum(g), sum(m), g[0], m[0], g[1], m[1]


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------
def plot_accuracy(runs, multiples, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for v, seeds in runs.items():
        means = [statistics.fmean(seed_accuracies(seeds, m)) for m in multiples]
        lo = [min(seed_accuracies(seeds, m)) for m in multiples]
        hi = [max(seed_accuracies(seeds, m)) for m in multiples]
        line, = ax.plot(multiples, means, marker="o", label=f"{label(v)} ({len(seeds)} seeds)")
        ax.fill_between(multiples, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(multiples, [f"{m}x" for m in multiples])
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("evaluation length / training length")
    ax.set_ylabel("passkey accuracy (all digits right)")
    ax.set_title("Passkey retrieval beyond the training length (line: mean; band: min-max over seeds)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prior_curve(module_name, params, distance):
    """The log-prior of every head at distances d >= 0: [H, len(distance)]."""
    fn = MATERIALISED_BIAS[module_name]
    p = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    d = torch.as_tensor(distance, dtype=torch.float64)
    if fn is None:
        return torch.zeros(1, len(d))
    return fn(p, d[None, :])[:, 0, :]


def plot_priors(runs, max_distance, train_length, path):
    """Learned log-prior per head (colour) and seed (line style), one panel per variant and
    layer; the dotted line is the start."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # (a prior over the model's own positions, FoX's gates, has no curve over distances)
    with_prior = [v for v in runs if MATERIALISED_BIAS.get(VARIANTS[v]["module"]) is not None]
    if not with_prior:
        return False
    layers = sorted(next(iter(runs[with_prior[0]].values()))["learned_prior"], key=int)
    fig, axes = plt.subplots(len(with_prior), len(layers), figsize=(4.2 * len(layers), 2.6 * len(with_prior)),
                             squeeze=False, sharex=True)
    d = torch.logspace(0, math.log10(max_distance), 200)
    styles = ["-", "--", "-.", ":"]
    for row, v in enumerate(with_prior):
        module = VARIANTS[v]["module"]
        for col, layer in enumerate(layers):
            ax = axes[row][col]
            for si, (seed, rec) in enumerate(runs[v].items()):
                curves = prior_curve(module, rec["learned_prior"][layer], d)
                for h in range(curves.shape[0]):
                    ax.plot(d, curves[h], color=f"C{h}", linestyle=styles[si % len(styles)],
                            linewidth=1, label=f"head {h}" if si == 0 else None)
            start = prior_curve(module, next(iter(runs[v].values()))["initial_prior"][layer], d)
            for h in range(start.shape[0]):
                ax.plot(d, start[h], color=f"C{h}", linestyle=(0, (1, 3)), linewidth=0.8, alpha=0.6)
            ax.axvline(train_length, color="grey", linewidth=0.8, linestyle="--")
            ax.set_xscale("log")
            ax.set_ylim(-30, 2)
            ax.set_title(f"{label(v)}, layer {layer}", fontsize=9)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("log-prior (nats)")
            if row == len(with_prior) - 1:
                ax.set_xlabel("distance i - j (tokens)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("Learned priors (colour: head; solid / dashed / dash-dot: seed 0 / 1 / 2; "
                 "dotted: start; grey line: training length)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------
def write_report(out, variants=None):
    """Write results.md (+ accuracy.png, priors.png) into out; returns the paths written."""
    runs = load_runs(out, variants)
    if not runs:
        raise SystemExit(f"no runs under {out}/runs: run the study first")
    cfg = next(iter(next(iter(runs.values())).values()))["config"]
    multiples, depths = cfg["multiples"], cfg["depths"]
    study, timing = _load_optional(out, "study.json"), _load_optional(out, "timing.json")
    paths = [os.path.join(out, "accuracy.png")]
    plot_accuracy(runs, multiples, paths[0])
    if plot_priors(runs, cfg["train_length"] * max(multiples), cfg["train_length"],
                   os.path.join(out, "priors.png")):
        paths.append(os.path.join(out, "priors.png"))
    readme = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"),
                             os.path.abspath(out))
    md = render_markdown(runs, cfg, study, timing, has_priors=len(paths) > 1, readme=readme)
    md += checks_section(out)
    paths.insert(0, os.path.join(out, "results.md"))
    with open(paths[0], "w") as f:
        f.write(md)
    return paths


def checks_section(out):
    """Extra runs kept under out/checks/<name>/ (each a full output folder of run.py, e.g. the
    same variant with the materialised-bias backend or more steps): a per-seed table each."""
    parts = []
    for folder in sorted(glob.glob(os.path.join(out, "checks", "*", "runs"))):
        check = os.path.dirname(folder)
        runs = load_runs(check)
        if not runs:
            continue
        cfg = next(iter(next(iter(runs.values())).values()))["config"]
        name = os.path.basename(check)
        parts.append(f"**[{name}](checks/{name}/results.md)**: {cfg['steps']} steps, backend "
                     f"{cfg['backend']}{', trained' + packing(cfg) if cfg.get('packed') else ''}, otherwise as above.\n\n"
                     + per_seed_table(runs, cfg["multiples"]))
    if not parts:
        return ""
    return ("\n## Further checks\n\nThe same settings rerun with one thing changed (see the "
            "README's *Calibration*).\n\n" + "\n\n".join(parts) + "\n")


def packing(cfg):
    """How the training rows were filled, when not one sample per row (run.py --packed)."""
    if not cfg.get("packed"):
        return ""
    return (f" on packed documents ({cfg['packed_min_length']} to {cfg['train_length']} "
            f"tokens each, every row filled exactly)")


def render_markdown(runs, cfg, study, timing, has_priors,
                    readme="../../experiments/passkey/README.md"):
    multiples, depths = cfg["multiples"], cfg["depths"]
    wall = (f"{study['wall_seconds'] / 60:.1f} min with {study['workers']} processes"
            if study else "not recorded")
    n_eval = cfg["eval_samples"] * len(depths)
    sections = [
        "# Passkey retrieval: results",
        f"Tiny decoders ({cfg['n_layers']} layers, d_model {cfg['d_model']}, {cfg['n_heads']} heads) "
        f"trained at length {cfg['train_length']}{packing(cfg)} for {cfg['steps']} steps (batch {cfg['batch']}, "
        f"AdamW lr {cfg['lr']:g}), attention through the bamgen-generated modules "
        f"(backend: {cfg['backend']}); evaluated at {', '.join(f'{m}x' for m in multiples)} the "
        f"training length, {cfg['eval_samples']} samples at each of {len(depths)} depths "
        f"({n_eval} per length, the same sequences for every model). Accuracy: all "
        f"passkey digits right under greedy decoding. Wall time of the run that wrote these "
        f"files: {wall} (on a shared machine it varies with the other load; the wall-time "
        f"section estimates it from measured rates). How to rerun and what each variant is: "
        f"[experiments/passkey/README.md]({readme}).",
        "## Headline", headline(runs, multiples),
        "## Accuracy by length (mean ± std over seeds, mean over depths)",
        "![accuracy against length](accuracy.png)", accuracy_table(runs, multiples),
        "### Per seed", per_seed_table(runs, multiples),
        "## Accuracy by depth (depth 0: passkey right after the start; 1: just before the question)",
        depth_tables(runs, multiples, depths),
        "## Training", training_table(runs),
        "## Learned prior parameters",
        ("![learned priors](priors.png)\n\n" if has_priors else "")
        + "Per layer and head; `init` is the start. bam / bam_ssmax: log-prior "
          "-exp(ta)·(|d| + 1e-5)^tb (tm frozen at 0), so exp(ta) is the slope and tb the shape "
          "(1: ALiBi-like, 0: flat, below 0: far keys favoured); BAM-SSMax multiplies the whole "
          "logit by ssmax·log(n). Laplace (ALiBi): -|d|/b with b = 1/slope, fixed.\n\n"
        + params_tables(runs),
        "## Wall time: generated CPU path vs a materialised bias",
        "The same models and batches with attention as the generated module's fused CPU path or "
        "as the usual approach (the prior as an [H, N, N] bias tensor with autograd, passed to "
        "SDPA as `attn_mask`). One thread each; the two take turns "
        f"({(timing or {}).get('rounds', '-')} rounds of {(timing or {}).get('steps_per_round', '-')} "
        "training steps and one evaluation batch per length; medians).",
        timing_section(timing, runs, study),
    ]
    return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------------------------------
# Reach of the learned priors (used by the long-context studies' reports)
# ----------------------------------------------------------------------------------------
def reach_cell(module_name, params, h, nats):
    """One head's reach in words: the distance where its learned log-prior is `nats` below its
    peak; for an anti-local head, how far below the far keys its near keys sit."""
    from inference import anti_local_penalty, reach
    one = {k: [v[h]] for k, v in params.items()}
    r = reach(module_name, one, nats)[0]
    if r is not None:
        return f"{r:,}"
    penalty = anti_local_penalty(module_name, one)[0]
    if penalty is not None:
        return "never; anti-local: " + ", ".join(f"d={d} -{p:.1f}" for d, p in penalty.items())
    return "never"


def reach_table(runs, nats=20.0):
    """Per variant with a learned or fixed prior: per seed and layer, each head's reach."""
    parts = []
    for v, seeds in runs.items():
        module = VARIANTS[v]["module"]
        if module in ("uniform",):
            continue
        first = next(iter(seeds.values()))
        heads = len(next(iter(first["learned_prior"]["0"].values())))
        rows = [[seed, layer] + [reach_cell(module, params, h, nats) for h in range(heads)]
                for seed, rec in seeds.items() for layer, params in rec["learned_prior"].items()]
        parts.append(f"**{label(v)}**\n\n" + _table(["seed", "layer"] + [f"head {h}" for h in range(heads)], rows))
    return "\n\n".join(parts)
