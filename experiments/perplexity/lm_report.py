"""The perplexity study's report, rebuilt from the saved runs: results.md, bpb.png and
bpb_by_position.png (and priors.png when a variant has a prior).

Nothing here trains; `run.py --report-only` calls write_report on an existing output folder.
"""
import os
import statistics

from report import (_load_optional, _table, label, load_runs, mean_std, params_tables,
                    plot_priors, reach_table)

ONE_X = 1


def seed_bpb(seeds, mult):
    return [rec["eval"][str(mult)]["bits_per_byte"] for rec in seeds.values()]


def fmt(xs, digits=3):
    m, s = mean_std(xs)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def bpb_table(runs, multiples):
    header = ["variant", "seeds"] + [f"{m}x ({m * _cfg(runs)['train_length']:,} B)" for m in multiples]
    rows = [[label(v), len(seeds)] + [fmt(seed_bpb(seeds, m)) for m in multiples]
            for v, seeds in runs.items()]
    return _table(header, rows)


def per_seed_table(runs, multiples):
    header = ["variant", "seed"] + [f"{m}x" for m in multiples]
    rows = [[label(v), seed] + [f"{rec['eval'][str(m)]['bits_per_byte']:.3f}" for m in multiples]
            for v, seeds in runs.items() for seed, rec in seeds.items()]
    return _table(header, rows)


def position_table(runs, mult):
    """Mean bits per byte by position bucket within a chunk at one length (mean over seeds)."""
    buckets = list(next(iter(next(iter(runs.values())).values()))["eval"][str(mult)]["by_position"])
    rows = [[label(v)] + [f"{statistics.fmean(r['eval'][str(mult)]['by_position'][b] for r in seeds.values()):.3f}"
                          for b in buckets] for v, seeds in runs.items()]
    return _table(["variant"] + [f"bytes {b}" for b in buckets], rows)


def context_gain(rec, mult, base):
    """{bucket: bits per byte at `mult` minus at `base` on the same bytes}, bucketed by position
    in the longest chunks (= in the pieces): negative where the longer context helps."""
    at = rec["eval"][str(mult)]["by_position"]
    ref = rec["eval"][str(base)]["by_piece_position"]
    return {b: at[b] - ref[b] for b in at}


def gain_table(runs, mult, base):
    buckets = list(next(iter(next(iter(runs.values())).values()))["eval"][str(mult)]["by_position"])
    rows = []
    for v, seeds in runs.items():
        gains = [context_gain(r, mult, base) for r in seeds.values()]
        rows.append([label(v)] + [fmt([g[b] for g in gains]) for b in buckets])
    return _table(["variant"] + [f"bytes {b}" for b in buckets], rows)


def _cfg(runs):
    return next(iter(next(iter(runs.values())).values()))["config"]


def headline(runs, multiples):
    """The claims, stated from the numbers whichever way they go: bits per byte at the training
    length against the best variant there, and how each variant changes out to the longest
    length."""
    lines = []
    at1 = {v: mean_std(seed_bpb(s, ONE_X)) for v, s in runs.items()} if ONE_X in multiples else {}
    if at1:
        best = min(at1, key=lambda v: at1[v][0])
        lines.append(f"- **At the training length (1x)** the lowest held-out bits per byte is "
                     f"{label(best)}'s, {at1[best][0]:.3f} ± {at1[best][1]:.3f}.")
        for v in runs:
            if v == best:
                continue
            diff = at1[v][0] - at1[best][0]
            lines.append(f"  - {label(v)}: {at1[v][0]:.3f} ± {at1[v][1]:.3f}, {diff:+.3f} bits/byte "
                         f"(per-byte perplexity x{2 ** diff:.3f}).")
    last = max(multiples)
    for v, seeds in runs.items():
        a = mean_std(seed_bpb(seeds, multiples[0]))
        z = mean_std(seed_bpb(seeds, last))
        best_m = min(multiples, key=lambda m: statistics.fmean(seed_bpb(seeds, m)))
        lines.append(f"- **{label(v)}**: {a[0]:.3f} at {multiples[0]}x, {z[0]:.3f} ± {z[1]:.3f} at "
                     f"{last}x ({z[0] - a[0]:+.3f}); lowest at {best_m}x "
                     f"({statistics.fmean(seed_bpb(seeds, best_m)):.3f}).")
    return "\n".join(lines)


def training_table(runs):
    header = ["variant", "train s / model", "final train bits/byte", "eval s / model"]
    rows = []
    for v, seeds in runs.items():
        recs = list(seeds.values())
        rows.append([label(v), f"{statistics.fmean(r['train_seconds'] for r in recs):.0f}",
                     fmt([r["curve"][-1]["bits_per_byte"] for r in recs]),
                     f"{statistics.fmean(sum(e['seconds'] for e in r['eval'].values()) for r in recs):.0f}"])
    return _table(header, rows)


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _label_off_scale(ax, xs, ys, top, color):
    """Write the value of each point above the plot's top edge at that edge."""
    for x, y in zip(xs, ys):
        if y > top:
            ax.annotate(f"{y:.2f}", (x, top), xytext=(0, -12), textcoords="offset points",
                        ha="center", fontsize=7, color=color)


def plot_bpb(runs, multiples, path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for v, seeds in runs.items():
        vals = [seed_bpb(seeds, m) for m in multiples]
        line, = ax.plot(multiples, [statistics.fmean(x) for x in vals], marker="o",
                        label=f"{label(v)} ({len(seeds)} seeds)")
        ax.fill_between(multiples, [min(x) for x in vals], [max(x) for x in vals],
                        color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(multiples, [f"{m}x" for m in multiples])
    ax.set_xlabel("evaluation chunk length / training length")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    lo = min(min(seed_bpb(s, m)) for s in runs.values() for m in multiples)
    at1 = max(max(seed_bpb(s, multiples[0])) for s in runs.values())
    top = max(at1 + 1.5, lo + 1.0)                       # a blow-up runs off the top: say its value
    ax.set_ylim(lo - 0.1, top)
    for i, seeds in enumerate(runs.values()):
        _label_off_scale(ax, multiples, [statistics.fmean(seed_bpb(seeds, m)) for m in multiples],
                         top, f"C{i}")
    ax.set_title("Byte-level LM on the Python stdlib, chunked evaluation (line: mean; band: min-max over seeds)",
                 fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_by_position(runs, mult, base, train_length, path):
    """Bits per byte at `mult` minus at `base` on the same bytes, by position in the chunk."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    buckets = list(next(iter(next(iter(runs.values())).values()))["eval"][str(mult)]["by_position"])
    ends = [int(b.split("-")[1]) for b in buckets]
    for i, (v, seeds) in enumerate(runs.items()):
        gains = [context_gain(r, mult, base) for r in seeds.values()]
        ys = [statistics.fmean(g[b] for g in gains) for b in buckets]
        line, = ax.plot(ends, ys, marker="o", label=label(v), color=f"C{i}")
        _label_off_scale(ax, ends, ys, 1.0, line.get_color())
        ax.fill_between(ends, [min(g[b] for g in gains) for b in buckets],
                        [max(g[b] for g in gains) for b in buckets], color=line.get_color(),
                        alpha=0.15, linewidth=0)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axvline(train_length, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ends, [f"{e:,}" for e in ends], fontsize=7)
    ax.set_xlabel(f"position in the {mult}x chunks (bucket end, bytes; grey: training length)")
    ax.set_ylabel(f"bits/byte at {mult}x minus at {base}x, same bytes")
    ax.set_ylim(-0.4, 1.0)
    ax.set_title(f"What the longer context does, byte for byte (below 0: it helps; line: mean, "
                 f"band: min-max over seeds)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------
def write_report(out, variants=None):
    """Write results.md and the plots into out; returns the paths written."""
    runs = load_runs(out, variants)
    if not runs:
        raise SystemExit(f"no runs under {out}/runs: run the study first")
    cfg = _cfg(runs)
    multiples = cfg["multiples"]
    paths = [os.path.join(out, "results.md"), os.path.join(out, "bpb.png"),
             os.path.join(out, "bpb_by_position.png")]
    plot_bpb(runs, multiples, paths[1])
    plot_by_position(runs, max(multiples), min(multiples), cfg["train_length"], paths[2])
    has_priors = plot_priors(runs, cfg["train_length"] * max(multiples), cfg["train_length"],
                             os.path.join(out, "priors.png"))
    if has_priors:
        paths.append(os.path.join(out, "priors.png"))
    readme = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"),
                             os.path.abspath(out))
    md = render_markdown(runs, cfg, _load_optional(out, "study.json"), has_priors, readme)
    with open(paths[0], "w") as f:
        f.write(md)
    return paths


def render_markdown(runs, cfg, study, has_priors, readme):
    multiples = cfg["multiples"]
    info = next(iter(next(iter(runs.values())).values()))["corpus"]
    wall = (f"{study['wall_seconds'] / 60:.1f} min over {len(study['sessions'])} session(s) with "
            f"{study['workers']} process(es) of one thread (load average at the end "
            f"{study['load_average_at_end']})" if study else "not recorded")
    longest, shortest = max(multiples), min(multiples)
    sections = [
        "# Perplexity on real text: results",
        f"Byte-level language models on the Python standard library's own source "
        f"(Python {info['python']}, `{info['stdlib']}`): {info['train_files']} files "
        f"({info['train_bytes']:,} bytes) train, {info['held_out_files']} files "
        f"({info['held_out_bytes']:,} bytes) held out by the rule *{info['split_rule']}*. "
        f"Tiny decoders ({cfg['n_layers']} layers, d_model {cfg['d_model']}, {cfg['n_heads']} heads, "
        f"vocabulary 257: bytes and BOS) trained on random {cfg['train_length']}-byte windows for "
        f"{cfg['steps']} steps of {cfg['batch']} windows ({cfg['steps'] * cfg['batch'] * cfg['train_length']:,} "
        f"bytes seen), attention through the bamgen-generated modules. Evaluation: "
        f"**chunked**: {cfg['eval_bytes']:,} held-out bytes, taken as {info['eval_pieces']} "
        f"contiguous pieces of {info['eval_piece_bytes']:,} bytes at evenly spaced offsets of the "
        f"held-out stream ({info['eval_files']} files), each cut into non-overlapping chunks of "
        f"{', '.join(f'{m}x' for m in multiples)} the training length; each chunk starts from "
        f"BOS with no context carried over and every byte is scored once, so every length "
        f"scores the same bytes. Wall time of the run that wrote these files: {wall}. "
        f"How to rerun and what each variant is: [experiments/perplexity/README.md]({readme}).",
        "## Headline", headline(runs, multiples),
        "## Held-out bits per byte by chunk length (mean ± std over seeds)",
        "![bits per byte against chunk length](bpb.png)", bpb_table(runs, multiples),
        "### Per seed", per_seed_table(runs, multiples),
        f"## Byte for byte: what the {longest}x context does",
        f"Bits per byte at {longest}x minus at {shortest}x on the same bytes, by position in "
        f"the {longest}x chunks (mean ± std over seeds). At {shortest}x every byte has at most "
        f"{cfg['train_length']} bytes of context; at {longest}x a byte in bucket [a, b) has a to "
        f"b. Below 0, the longer context helps; above 0, the model is worse with more context "
        f"than without it. The first bucket is 0 by construction (the same context).",
        "![context gain by position](bpb_by_position.png)", gain_table(runs, longest, shortest),
        f"The absolute bits per byte by position in the {longest}x chunks (each column holds "
        f"different bytes, so compare variants within a column):",
        position_table(runs, longest),
        "## Training", training_table(runs),
        "## Learned prior parameters",
        ("![learned priors](priors.png)\n\n" if has_priors else "")
        + "Per layer and head; `init` is the start. bam / bam_ssmax: log-prior "
          "-exp(ta)·(|d| + 1e-5)^tb (tm frozen at 0); BAM-SSMax multiplies the whole logit by "
          "ssmax·log(n). Laplace (ALiBi): -|d|/b, fixed.\n\n" + params_tables(runs),
        "### Reach per head",
        "The distance where each head's learned log-prior is 20 nats below its peak (`bamgen "
        "show`'s reach column, evaluated at the trained parameters); for an anti-local head, how "
        "many nats a key at distance 1, 8 and 64 sits below a far one. For BAM-SSMax the logit "
        "multiplies the log-prior by ssmax·log(n), so its effective reach at n keys is shorter "
        "when ssmax·log(n) > 1.\n\n" + reach_table(runs),
    ]
    return "\n\n".join(sections) + "\n"
