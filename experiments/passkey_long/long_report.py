"""The long-passkey study's report, rebuilt from the saved runs: results.md and accuracy_long.png.

Nothing here evaluates; `run.py --report-only` calls write_report on an existing output folder.
"""
import os
import statistics

from long_eval import wilson
from report import _load_optional, _table, label, load_runs, mean_std, reach_table

COMMITTED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "docs", "results")


def multiples_of(runs):
    return sorted({int(m) for seeds in runs.values() for r in seeds.values() for m in r["cells"]})


def counts(rec, mult, depth=None):
    """(right, total) of one model at one length (one depth, or all)."""
    cells = rec["cells"].get(str(mult), {})
    right = total = 0
    for d, cell in cells.items():
        if depth is not None and d != str(depth):
            continue
        for flags in cell["groups"].values():
            right, total = right + sum(flags), total + len(flags)
    return right, total


def pooled(seeds, mult, depth=None):
    right = total = 0
    for rec in seeds.values():
        r, t = counts(rec, mult, depth)
        right, total = right + r, total + t
    return right, total


def fmt_wilson(right, total):
    if not total:
        return "-"
    lo, hi = wilson(right, total)
    return f"{right / total:.2f} [{lo:.2f}, {hi:.2f}] ({right}/{total})"


def seed_means(seeds, mult):
    out = []
    for rec in seeds.values():
        r, t = counts(rec, mult)
        if t:
            out.append(r / t)
    return out


def pooled_table(runs, mults):
    rows = [[label(v), len(seeds)] + [fmt_wilson(*pooled(seeds, m)) for m in mults]
            for v, seeds in runs.items()]
    return _table(["variant", "seeds"] + [f"{m}x" for m in mults], rows)


def seed_mean_table(runs, mults):
    rows = []
    for v, seeds in runs.items():
        cells = []
        for m in mults:
            xs = seed_means(seeds, m)
            cells.append(f"{mean_std(xs)[0]:.2f} ± {mean_std(xs)[1]:.2f}" if xs else "-")
        rows.append([label(v)] + cells)
    return _table(["variant"] + [f"{m}x" for m in mults], rows)


def per_seed_table(runs, mults):
    rows = [[label(v), seed] + [fmt_wilson(*counts(rec, m)) for m in mults]
            for v, seeds in runs.items() for seed, rec in seeds.items()]
    return _table(["variant", "seed"] + [f"{m}x" for m in mults], rows)


def depth_tables(runs, mults, depths):
    parts = []
    for v, seeds in runs.items():
        rows = [[f"{float(d):.2f}"] + [fmt_wilson(*pooled(seeds, m, d)) for m in mults] for d in depths]
        parts.append(f"**{label(v)}** (pooled over {len(seeds)} seed(s))\n\n"
                     + _table(["depth"] + [f"{m}x" for m in mults], rows))
    return "\n\n".join(parts)


def reproduce_table(runs):
    """Each retrained model's accuracy on the passkey study's own samples next to the committed
    number: equal when the training reproduced the committed model."""
    rows = []
    for v, seeds in runs.items():
        for seed, rec in seeds.items():
            for m, cell in sorted(rec.get("reproduce", {}).items(), key=lambda kv: int(kv[0])):
                mine = statistics.fmean(cell.values())
                committed = (rec.get("committed") or {}).get(m)
                theirs = statistics.fmean(committed.values()) if committed else None
                same = "-" if committed is None else ("yes" if committed == cell else "no")
                rows.append([label(v), seed, f"{m}x", f"{mine:.2f}",
                             "-" if theirs is None else f"{theirs:.2f}", same])
    if not rows:
        return "_Not run (`--reproduce` empty)._"
    return _table(["variant", "seed", "length", "retrained", "committed study", "identical per depth"], rows)


def reproduce_text(runs):
    """Whether retraining gave the committed models, from the per-depth accuracies."""
    same = [rec["committed"][m] == cell for seeds in runs.values() for rec in seeds.values()
            if rec.get("committed") for m, cell in rec.get("reproduce", {}).items()
            if m in rec["committed"]]
    text = ("Each model is retrained here with the passkey study's default settings and seed, "
            "then scored on that study's own samples at the same length.")
    if not same:
        return text + " No committed run with these settings was found to compare with."
    if all(same):
        return text + f" All {len(same)} agree with the committed study at every depth: the same models."
    return (text + f" {sum(same)} of {len(same)} agree at every depth. The others are not "
            "bit-identical to the committed models: the generated CPU path's floating-point "
            "rounding has changed since that run (the prior's bias is now added in natural units "
            "before the base-2 scaling), and over 500 steps small differences move the weights. "
            "The accuracies show how close the retrained models are.")


def cost_table(runs, mults):
    """Seconds per sample, layer-0 attention work left after skipping, and the skip check."""
    rows = []
    for v, seeds in runs.items():
        for m in mults:
            secs, work, agree, diff, full = [], [], [], [], []
            for rec in seeds.values():
                for depth_cell in rec["cells"].get(str(m), {}).values():
                    secs += list(depth_cell["seconds"].values())
                if str(m) in rec["work"]:
                    work.append(rec["work"][str(m)])
                for chk in rec["checks"].get(str(m), {}).values():
                    agree.append(chk["agree"])
                    diff.append(chk["max_abs_logit_diff"])
                    full.append(chk["seconds_full"])
            size = next(iter(seeds.values()))["eval_config"]["group_size"]
            if not secs:
                continue
            per = statistics.fmean(secs) / size
            rows.append([label(v), f"{m}x", f"{per:.2f}",
                         f"{100 * statistics.fmean(work):.1f}%" if work else "-",
                         f"{sum(agree)}/{len(agree)}" if agree else "-",
                         f"{max(diff):.1e}" if diff else "-",
                         f"{statistics.fmean(full) / size / per:.1f}x" if full else "-"])
    return _table(["variant", "length", "s / sample", "layer-0 attention pairs computed",
                   "skip check: same digits", "max abs logit diff", "time without skipping"], rows)


def windows_table(runs, mult):
    rows = []
    for v, seeds in runs.items():
        for seed, rec in seeds.items():
            w = rec["windows"].get(str(mult))
            if not w:
                continue
            for layer, heads in enumerate(w):
                rows.append([label(v), seed, layer] + ["all" if x is None else f"{x:,}" for x in heads])
    if not rows:
        return "_No skipping._"
    heads = max(len(r) - 3 for r in rows)
    return _table(["variant", "seed", "layer"] + [f"head {h}" for h in range(heads)], rows)


def committed_curve(variant):
    """(multiples, mean over seeds) of the committed passkey study for this variant."""
    runs = load_runs(COMMITTED, [variant]).get(variant)
    if not runs:
        return [], []
    first = next(iter(runs.values()))["config"]["multiples"]
    return first, [statistics.fmean(statistics.fmean(r["accuracy"][str(m)].values()) for r in runs.values())
                   for m in first]


def plot(runs, mults, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (v, seeds) in enumerate(runs.items()):
        color = f"C{i}"
        xs, ys = committed_curve(v)
        if xs:
            ax.plot(xs, ys, color=color, marker="o", linestyle="--", alpha=0.6, linewidth=1)
        pts = [(m, *pooled(seeds, m)) for m in mults]
        pts = [(m, r / t, *wilson(r, t)) for m, r, t in pts if t]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                        yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        color=color, marker="s", capsize=3, label=f"{label(v)} ({len(seeds)} seeds)")
    ax.set_xscale("log", base=2)
    ticks = [1, 4, 16, 64] + mults
    ax.set_xticks(ticks, [f"{t}x" for t in ticks])
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("evaluation length / training length (64 tokens)")
    ax.set_ylabel("passkey accuracy (all 4 digits, greedy)")
    ax.set_title("Passkey retrieval to 512x: squares, pooled over seeds with Wilson 95% intervals; "
                 "dashed: the passkey study (1x-64x)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out, variants=None):
    runs = load_runs(out, variants)
    if not runs:
        raise SystemExit(f"no runs under {out}/runs: run the study first")
    mults = multiples_of(runs)
    paths = [os.path.join(out, "results.md"), os.path.join(out, "accuracy_long.png")]
    plot(runs, mults, paths[1])
    readme = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"),
                             os.path.abspath(out))
    with open(paths[0], "w") as f:
        f.write(render_markdown(runs, mults, _load_optional(out, "study.json"), readme))
    return paths


def render_markdown(runs, mults, study, readme):
    first = next(iter(next(iter(runs.values())).values()))
    cfg, ecfg = first["config"], first["eval_config"]
    depths = ecfg["depths"]
    seeds0 = next(iter(runs.values()))
    lengths = ", ".join(f"{m}x ({m * cfg['train_length']:,} tokens)" for m in mults)
    per_model = ", ".join(f"{m}x: {pooled(seeds0, m)[1] // len(seeds0)}" for m in mults)
    wall = "not recorded"
    if study:
        wall = (f"{study['wall_seconds'] / 60:.1f} min over {len(study['sessions'])} session(s), "
                f"one process with one thread (load average at the end "
                f"{study['load_average_at_end']})")
    skip = (f"keys whose learned log-prior is more than {ecfg['skip_nats']:g} nats below the head's "
            f"peak are skipped" if ecfg.get("skip_nats") else "no block skipping")
    sections = [
        "# Passkey retrieval at 128x to 512x: results",
        f"The passkey study's models (experiments/passkey: {cfg['n_layers']} layers, d_model "
        f"{cfg['d_model']}, {cfg['n_heads']} heads, trained at length {cfg['train_length']} for "
        f"{cfg['steps']} steps with its default settings and seeds) evaluated at "
        f"{lengths}. Passkeys at "
        f"{len(depths)} depths ({', '.join(f'{d:g}' for d in depths)}), groups of "
        f"{ecfg['group_size']} samples per depth, the same sequences for every model; samples per "
        f"model and length: {per_model}. "
        f"A sample is right when greedy decoding with a KV cache writes all 4 digits. Attention "
        f"runs through the generated modules' CPU path; {skip} (see *Cost*). Intervals: Wilson "
        f"95%, treating samples as independent (pooled rows also pool the seeds, whose models "
        f"differ: the mean ± std over seeds shows that spread). Wall time: {wall}. How to rerun: "
        f"[experiments/passkey_long/README.md]({readme}).",
        "## Accuracy (pooled over seeds, Wilson 95% interval, right/total)",
        "![accuracy to 512x](accuracy_long.png)", pooled_table(runs, mults),
        "### Mean ± std over seeds", seed_mean_table(runs, mults),
        "### Per seed", per_seed_table(runs, mults),
        "## Accuracy by depth (0: passkey right after the start, the farthest from the question)",
        depth_tables(runs, mults, depths),
        "## The retrained models against the committed passkey study",
        reproduce_text(runs), reproduce_table(runs),
        "## Reach of the learned priors",
        "The distance where each head's learned log-prior is 20 nats below its peak (`bamgen "
        "show`'s reach, at the trained parameters). An anti-local head (log-prior rising with "
        "distance, so far keys are favoured) never falls that far behind its peak; its cell gives "
        "how many nats a key at distance 1, 8 and 64 sits below a far one.\n\n" + reach_table(runs),
        "## Cost: KV cache and block skipping",
        "Each sample: one prefill pass over the prompt, with the last layer's attention for the "
        "last row only, then one decoding step per digit against the cache. Layer 0's heads with a "
        f"finite window attend to keys within that window only. The skip check decodes "
        f"{'one group' if ecfg.get('skip_nats') else 'no group'} per model and length (depth 0) "
        "again without skipping and compares the digits and every step's logits.",
        cost_table(runs, mults),
        f"### Windows at {max(mults)}x (keys kept per head; all = no skipping)",
        windows_table(runs, max(mults)),
    ]
    return "\n\n".join(sections) + "\n"
