"""The comparison chart (``run_eval --plot``): accuracy per run, the paired difference with the interval
the test uses, teacher-forced KL and top-1 agreement per question, throughput per phase, and where the
generations first differ. Runs are labelled by their backends."""
from __future__ import annotations

from attnzoo.evals import stats

A_COLOR, B_COLOR = "tab:blue", "tab:orange"


def _side_label(side: dict, name: str) -> str:
    kv = f", KV {side['kv_cache_dtype']}" if side.get("kv_cache_dtype") not in (None, "auto") else ""
    return f"{name}: {side['prefill_backend']}/{side['decode_backend']}, page {side['page_size']}{kv}"


def write_chart(report: dict, path, write_atomically) -> str | None:
    """Write the PNG through ``write_atomically(path, write(binary file))``; returns why not when matplotlib
    is missing (run_eval checks it before the run) or the file cannot be written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; set only when a chart is asked for
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    cmp = report["comparison"]
    la, lb = _side_label(cmp["a"], "A"), _side_label(cmp["b"], "B")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (acc, diff, hist), (kl, top1, speed) = axes

    names = [f"{m['task']}\n{m['filter']}" for m in cmp["metrics"]]
    x = range(len(names))
    for offset, key, color, label in ((-0.2, "accuracy_a", A_COLOR, la), (0.2, "accuracy_b", B_COLOR, lb)):
        ps = [m[key] for m in cmp["metrics"]]
        ivs = [stats.wilson_interval(p, m["n"]) for p, m in zip(ps, cmp["metrics"])]
        acc.bar([i + offset for i in x], [100 * p for p in ps], width=0.4, color=color, label=label,
                yerr=[[100 * (p - lo) for p, (lo, _) in zip(ps, ivs)], [100 * (hi - p) for p, (_, hi) in zip(ps, ivs)]],
                capsize=4)
    acc.set_xticks(list(x), names, fontsize=8)
    acc.set_ylabel("accuracy % (95% Wilson interval)")
    acc.set_ylim(bottom=0)
    acc.legend(fontsize=7, loc="lower right")
    acc.set_title("accuracy per run", fontsize=9)

    d = [100 * m["difference"] for m in cmp["metrics"]]
    lo = [100 * (m["difference"] - m["ci95"][0]) for m in cmp["metrics"]]
    hi = [100 * (m["ci95"][1] - m["difference"]) for m in cmp["metrics"]]
    diff.errorbar(list(x), d, yerr=[lo, hi], fmt="o", color="black", capsize=6, label="B - A, paired 95% interval")
    diff.axhline(0, color="gray", lw=1)
    for i, m in enumerate(cmp["metrics"]):
        diff.annotate(f"McNemar p={m['mcnemar_p']:.3g}\nA only {m['only_a']}, B only {m['only_b']}", (i, d[i]),
                      textcoords="offset points", xytext=(8, 0), fontsize=7)
    diff.set_xticks(list(x), names, fontsize=8)
    diff.set_xlim(-0.5, len(names) - 0.5 + 0.6)
    diff.set_ylabel("accuracy B - A, percentage points")
    diff.legend(fontsize=7)
    diff.set_title(f"accuracy: {cmp['accuracy_verdict']}", fontsize=9)

    rows = [r for task_rows in cmp["per_question"].values() for r in task_rows]
    pos = [r["first_divergence"] for r in rows if not r["identical"] and r["first_divergence"] is not None]
    tl = cmp["token_level"]
    if pos:
        hist.hist(pos, bins=min(40, max(5, len(set(pos)))), color="tab:gray", label="questions whose outputs differ")
        hist.legend(fontsize=7)
    else:
        hist.text(0.5, 0.5, "no generation differs", ha="center", va="center", transform=hist.transAxes)
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.set_xlabel("position of the first differing output token")
    hist.set_ylabel("questions")
    hist.set_title(f"{tl['identical_generations']}/{tl['questions']} generations identical; verdict: {cmp['verdict']}",
                   fontsize=9)

    forced = [(r["doc_id"], r["teacher_forced"]) for r in rows if r.get("teacher_forced") and r["teacher_forced"]["tokens"]]
    if forced:
        kl.scatter([f["kl_mean"] for _, f in forced], [f["kl_max"] for _, f in forced], s=12, color=B_COLOR,
                   label="one question (teacher-forced on A's tokens)")
        kl.set_xscale("symlog", linthresh=1e-9)
        kl.set_yscale("symlog", linthresh=1e-9)
        kl.legend(fontsize=7)
        agree_b = [100 * f["top1_agreement_b"] for _, f in forced]
        agree_a = [100 * f["top1_agreement_a"] for _, f in forced]
        top1.hist([agree_a, agree_b], bins=10, color=[A_COLOR, B_COLOR], label=["A's own argmax", "B's argmax"])
        top1.legend(fontsize=7)
    else:
        for ax in (kl, top1):
            ax.text(0.5, 0.5, "not teacher-forced\n(--logit-compare-limit)", ha="center", va="center", transform=ax.transAxes)
    kl.set_xlabel("KL(A || B) mean per position, nats")
    kl.set_ylabel("KL(A || B) max, nats")
    kl.set_title("teacher-forced KL per question", fontsize=9)
    top1.yaxis.set_major_locator(MaxNLocator(integer=True))
    top1.set_xlabel("% of positions whose argmax is A's token")
    top1.set_ylabel("questions")
    top1.set_title("teacher-forced top-1 agreement", fontsize=9)

    sp = cmp.get("speed") or {}
    phases = [k for k in ("output_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
              if (sp.get(k) or {}).get("a") is not None or (sp.get(k) or {}).get("b") is not None]
    for offset, side, color, label in ((-0.2, "a", A_COLOR, la), (0.2, "b", B_COLOR, lb)):
        bars = speed.bar([i + offset for i in range(len(phases))], [sp[k][side] or 0 for k in phases], width=0.4,
                         color=color, label=label)
        speed.bar_label(bars, labels=[f"{sp[k][side]:.3g}" if sp[k][side] else "" for k in phases], fontsize=7)
    values = [sp[k][side] for k in phases for side in ("a", "b") if sp[k][side]]
    if values and max(values) > 20 * min(values):  # prefill runs far faster than decode: keep both readable
        speed.set_yscale("log")
    speed.set_xticks(range(len(phases)), [k.replace("_tokens_per_s", "") for k in phases], fontsize=8)
    speed.set_ylabel("tokens / s")
    ratio = (sp.get("output_tokens_per_s") or {}).get("b_over_a")
    speed.set_title("throughput" + ("" if ratio is None else f": B/A = {ratio:.2f}x output")
                    + ("" if sp.get("same_device", True) else " (different devices)"), fontsize=9)
    speed.legend(fontsize=7)
    fig.tight_layout()
    try:
        write_atomically(path, lambda fh: fig.savefig(fh, dpi=110, format="png"))
    except OSError as e:
        return f"cannot write {path} ({e.strerror or e})"
    finally:
        plt.close(fig)
    return None
