"""Turn lm-eval's results into our report (a JSON-able dict) and render it for the terminal.

A report holds one run: model, Decision, device, versions, per-task metrics per filter, invalid rates,
timing and throughput, and one record per question (with its generated token ids). A comparison of
two runs holds paired accuracy statistics per (task, filter), token-level evidence per question and in
total (``attnzoo.evals.tokens``), and two verdicts: the token-level one and the accuracy one.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from attnzoo.errors import EvalError
from attnzoo.evals import stats, tokens

REPORT_FORMAT = 1
TOKEN_IDENTICAL = "token-identical"
LOGIT_LEVEL_ONLY = "differs at the logit level only"
WITHIN_ROUNDING = "identical within float32 rounding"
# Two float32 runs that only sum in another order differ by ~1e-8 nats of KL; this bound is that noise
# floor with room, far below what a bf16 kernel or a real change leaves (>= 1e-5).
FLOAT32_KL_FLOOR = 1e-6
CHANGES_ANSWERS = "changes answers"
# lm-eval's regex filter answers this when its pattern finds nothing ("no number extracted").
INVALID = "[invalid]"
# Per-question right/wrong comes from the first of these metrics that the task reports.
BINARY_METRICS = ("exact_match", "acc")
_VERSIONED = {
    "attnzoo": "attnzoo", "torch": "torch", "transformers": "transformers", "lm_eval": "lm_eval",
    "triton": "triton", "flashinfer": "flashinfer-python", "datasets": "datasets", "gguf": "gguf",
}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for key, dist in _VERSIONED.items():
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            if key == "attnzoo":  # running from a source checkout that is not pip-installed
                import attnzoo

                out[key] = attnzoo.__version__
    try:
        import torch

        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def device_info(device) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    info: dict[str, Any] = {"device": str(dev)}
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info.update(name=props.name, compute_capability=f"sm{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["name"] = _cpu_name()
        info["threads"] = torch.get_num_threads()
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------ per-question records


def _primary_metric(sample: dict) -> str | None:
    return next((m for m in BINARY_METRICS if m in sample), None)


def _scalar(x):
    # lm-eval wraps per-request values in lists (one per repeat); gsm8k has one repeat.
    while isinstance(x, (list, tuple)) and len(x) == 1:
        x = x[0]
    return x


def per_question(samples: Iterable[dict], generations: dict[int, Any] | None = None) -> list[dict]:
    """One record per document from lm-eval's logged samples (one sample per document and filter)."""
    by_doc: dict[int, dict] = {}
    for s in samples:
        doc_id = int(s["doc_id"])
        rec = by_doc.setdefault(doc_id, {
            "doc_id": doc_id, "prompt_hash": s.get("prompt_hash"), "target": _scalar(s.get("target")),
            "answers": {}, "correct": {}, "response": _scalar(_scalar(s.get("resps"))),
        })
        metric = _primary_metric(s)
        rec["answers"][s["filter"]] = _scalar(s.get("filtered_resps"))
        # Only a 0/1 score says right or wrong; anything else (a partial score) has no place in McNemar.
        if metric is not None and float(s[metric]) in (0.0, 1.0):
            rec["correct"][s["filter"]] = float(s[metric]) == 1.0
    records = [by_doc[k] for k in sorted(by_doc)]
    for rec in records:
        g = (generations or {}).get(rec["doc_id"])
        if g is not None:
            rec.update(output_tokens=g.output_tokens, prompt_tokens=g.prompt_tokens, finish_reason=g.finish_reason,
                       output_token_ids=list(g.output_ids))
    return records


def task_metrics(task_results: dict, records: list[dict]) -> dict[str, dict]:
    """{filter: {metric: value, metric_stderr: value, invalid_rate: ...}} from lm-eval's results."""
    out: dict[str, dict] = defaultdict(dict)
    for key, value in task_results.items():
        if "," not in key:
            continue
        metric, flt = key.split(",", 1)
        out[flt][metric] = None if value == "N/A" or (isinstance(value, float) and math.isnan(value)) else value
    n = len(records)
    for flt in out:
        if n and all(flt in r["answers"] for r in records):
            out[flt]["invalid_rate"] = sum(1 for r in records if r["answers"][flt] == INVALID) / n
    return dict(out)


def build_run(*, task_results: dict[str, dict], samples: dict[str, list], lm, info: dict, decision, wall_s: float,
              settings: dict, label: str) -> dict:
    """The report of one run (JSON-able)."""
    gens: dict[str, dict[int, Any]] = defaultdict(dict)
    for g in lm.records:
        gens[g.task_name][g.doc_id] = g
    tasks = {}
    for name, res in task_results.items():
        records = per_question(samples.get(name, []), gens.get(name))
        tasks[name] = {"num_questions": len(records), "metrics": task_metrics(res, records), "per_question": records}
    out_tokens = sum(g.output_tokens for g in lm.records)
    gen_s = lm.generation_seconds
    return {
        "format": REPORT_FORMAT,
        "label": label,
        "model": info["model"],
        "architecture": info["architecture"],
        "decision": decision.to_dict(),
        "decision_explain": decision.explain(),
        "dtype": info["dtype"],
        "device": device_info(info["device"]),
        "versions": versions(),
        "settings": settings,
        "tasks": tasks,
        "timing": {
            "wall_s": wall_s,
            "generation_s": gen_s,
            "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / gen_s if gen_s > 0 else None,
        },
    }


# ------------------------------------------------------------------------------ comparison


def compare_runs(a: dict, b: dict, alpha: float = 0.05, forced: "tokens.ForcedResult | None" = None,
                 forced_note: str | None = None) -> dict:
    """Run B against run A on the questions both answered: paired accuracy statistics per (task, filter),
    token-level evidence per question (``forced``: the teacher-forced statistics, where computed), and the
    verdicts."""
    results: dict[str, stats.PairedResult] = {}
    per_metric = []
    identical: dict[str, dict] = {}
    token_rows: dict[str, list[dict]] = {}
    for task, ta in a["tasks"].items():
        tb = b["tasks"].get(task)
        if tb is None:
            raise EvalError(f"run B has no results for task {task!r}", fix="compare runs of the same task")
        ra = {r["doc_id"]: r for r in ta["per_question"]}
        rb = {r["doc_id"]: r for r in tb["per_question"]}
        if sorted(ra) != sorted(rb):
            raise EvalError(
                f"the two runs of {task!r} answered different questions ({len(ra)} vs {len(rb)} documents)",
                fix="use the same --limit, task and data for both runs",
            )
        ids = sorted(ra)
        if not ids:
            raise EvalError(f"run A has no per-question records for task {task!r}", fix="re-run with --output to save them")
        changed_prompts = [i for i in ids if ra[i].get("prompt_hash") != rb[i].get("prompt_hash")]
        if changed_prompts:
            raise EvalError(
                f"the two runs of {task!r} gave different prompts for {len(changed_prompts)} questions "
                f"(first: document {changed_prompts[0]})",
                fix="use the same --num-fewshot, --apply-chat-template and data for both runs",
            )
        filters = [f for f in ra[ids[0]]["correct"] if all(f in ra[i]["correct"] and f in rb[i]["correct"] for i in ids)]
        if not filters:
            raise EvalError(f"task {task!r} has no per-question right/wrong metric ({' or '.join(BINARY_METRICS)})",
                            fix="--compare-to needs a task scored by exact_match or acc")
        for flt in filters:
            r = stats.paired_compare([ra[i]["correct"][flt] for i in ids], [rb[i]["correct"][flt] for i in ids])
            same = sum(1 for i in ids if ra[i]["answers"].get(flt) == rb[i]["answers"].get(flt))
            results[f"{task},{flt}"] = r
            per_metric.append({"task": task, "filter": flt, **r.to_dict(), "answers_agree": same,
                               "answer_agreement": same / len(ids)})
        identical[task] = {"n": len(ids), "responses_identical": sum(1 for i in ids if ra[i].get("response") == rb[i].get("response"))}
        token_rows[task] = [_token_row(task, ra[i], rb[i], forced) for i in ids]
    accuracy_verdict, threshold = stats.verdict(results, alpha)
    rows = [r for task_rows in token_rows.values() for r in task_rows]
    both_float32 = a.get("dtype") == b.get("dtype") == "float32"
    token_level = _token_totals(rows, forced, forced_note, kl_floor=FLOAT32_KL_FLOOR if both_float32 else 0.0)
    return {
        "a": _run_label(a), "b": _run_label(b),
        "metrics": per_metric,
        "tasks": identical,
        "alpha": alpha,
        "per_test_threshold": threshold,
        "accuracy_verdict": accuracy_verdict,
        "speed": speed_ratio(a, b),
        "token_level": token_level,
        "per_question": token_rows,
        "verdict": token_level["verdict"],
        "verdict_reason": token_level["verdict_reason"],
    }


def _token_row(task: str, ra: dict, rb: dict, forced) -> dict:
    ta, tb = ra.get("output_token_ids"), rb.get("output_token_ids")
    if ta is not None and tb is not None:
        first = tokens.first_difference(ta, tb)
        same = first is None
    else:  # a report saved before token ids were recorded: only the text can be compared
        first, same = None, ra.get("response") == rb.get("response")
    row = {"doc_id": ra["doc_id"], "identical": same, "first_divergence": first,
           "tokens_a": len(ta) if ta is not None else None, "tokens_b": len(tb) if tb is not None else None,
           "answers_same": ra["answers"] == rb["answers"]}
    st = forced.per_question.get((task, ra["doc_id"])) if forced is not None else None
    row["teacher_forced"] = st.to_dict() if st is not None else None
    return row


def _token_totals(rows: list[dict], forced, forced_note: str | None, kl_floor: float = 0.0) -> dict:
    n = len(rows)
    same = sum(r["identical"] for r in rows)
    changed = sum(not r["answers_same"] for r in rows)
    measured = [forced.per_question[k] for k in forced.per_question] if forced is not None else []
    tf = tokens.summarize_forced(measured)
    tf["note"] = forced_note
    out = {
        "questions": n,
        "identical_generations": same,
        "identical_rate": same / n if n else None,
        "first_divergence": tokens.divergence_summary([r["first_divergence"] if not r["identical"] else None for r in rows]),
        "answers_changed": changed,
        "teacher_forced": tf,
    }
    logits_equal = tf["tokens"] == 0 or (tf["kl_max"] == 0.0 and tf["top1_agreement_b"] == tf["top1_agreement_a"])
    if changed:
        out["verdict"] = CHANGES_ANSWERS
        out["verdict_reason"] = f"the extracted answer differs on {changed} of {n} questions"
    elif same == n and logits_equal:
        out["verdict"] = TOKEN_IDENTICAL
        out["verdict_reason"] = ("every generation is token for token the same" +
                                 (f", and teacher-forced KL is 0 over {tf['tokens']} positions" if tf["tokens"]
                                  else " (logits not compared: no teacher forcing)"))
    elif same == n and tf["tokens"] and tf["kl_max"] <= kl_floor and tf["top1_agreement_b"] == tf["top1_agreement_a"]:
        out["verdict"] = WITHIN_ROUNDING
        out["verdict_reason"] = (f"every generation is token for token the same; teacher-forced KL(A||B) max "
                                 f"{tf['kl_max']:.3g} nats over {tf['tokens']} positions is under the float32 noise "
                                 f"floor {kl_floor:g}, and the top-1 agreement equals A's own")
    else:
        out["verdict"] = LOGIT_LEVEL_ONLY
        why = []
        if same < n:
            why.append(f"{n - same} of {n} generations differ")
        if tf["tokens"]:
            why.append(f"teacher-forced KL(A||B) mean {tf['kl_mean']:.3g}, max {tf['kl_max']:.3g} nats, "
                       f"B's top-1 agrees with A's token at {100 * tf['top1_agreement_b']:.2f}% of {tf['tokens']} positions")
        out["verdict_reason"] = "; ".join(why) + "; every extracted answer is the same"
    return out


def _run_label(run: dict) -> dict:
    d = run["decision"]
    return {"label": run.get("label"), "prefill_backend": d["prefill_backend"], "decode_backend": d["decode_backend"],
            "page_size": d["page_size"], "kv_cache_dtype": (run.get("settings") or {}).get("kv_cache_dtype")}


def speed_ratio(a: dict, b: dict) -> dict:
    """B's speed over A's: output tokens per generation second, and per phase where both runs recorded it.
    Two runs on different machines or loads compare the machines too: the report says where each ran."""
    def rate(run, *path):
        x = run
        for key in path:
            x = x.get(key) if isinstance(x, dict) else None
        return x

    out = {}
    for name, path in (("output_tokens_per_s", ("timing", "output_tokens_per_s")),
                       ("prefill_tokens_per_s", ("performance", "throughput", "prefill_tokens_per_s")),
                       ("decode_tokens_per_s", ("performance", "throughput", "decode_tokens_per_s"))):
        ra, rb = rate(a, *path), rate(b, *path)
        out[name] = {"a": ra, "b": rb, "b_over_a": rb / ra if ra and rb else None}
    same = (a.get("device") or {}).get("name") == (b.get("device") or {}).get("name")
    out["same_device"] = same
    return out


def render_performance(run: dict) -> list[str]:
    """The run's latency distributions, phase throughput, memory, engine state and provenance, in lines."""
    perf, prov = run.get("performance"), run.get("provenance") or {}
    if not perf:
        return []
    lines = []

    def dist(name, d):
        if d:
            lines.append(f"  {name}: mean {1000 * d['mean']:.1f} ms, p50 {1000 * d['p50']:.1f}, p90 {1000 * d['p90']:.1f}, "
                         f"p99 {1000 * d['p99']:.1f}, max {1000 * d['max']:.1f} ms over {d['n']} requests")

    dist("TTFT (from its wave's start)", perf.get("ttft_s"))
    dist("TPOT", perf.get("tpot_s"))
    th = perf.get("throughput") or {}

    def tps(x):
        return "n/a" if x is None else f"{x:.1f} tok/s"

    lines.append(f"  prefill {th.get('prefill_tokens')} tokens, {tps(th.get('prefill_tokens_per_s'))}; decode "
                 f"{th.get('decode_tokens')} tokens, {tps(th.get('decode_tokens_per_s'))} ({th.get('steps')} steps)")
    mem, eng = perf.get("memory") or {}, perf.get("engine") or {}
    gpu = f", GPU peak {mem['gpu_peak_allocated_gib']} GiB allocated" if "gpu_peak_allocated_gib" in mem else ""
    lines.append(f"  memory: host peak RSS {mem.get('host_peak_rss_gib')} GiB{gpu}; KV capacity {eng.get('kv_cache_tokens')} "
                 f"tokens ({eng.get('kv_dtype')}), max running {eng.get('max_running')}, CUDA graphs "
                 f"{'off' if not eng.get('cuda_graph') else eng['cuda_graph'].get('batch_buckets')}, cascade "
                 f"{str(eng.get('cascade')).split(':')[0]}")
    git, ck = prov.get("attnzoo_git") or {}, prov.get("checkpoint") or {}
    if prov:
        commit = "not a git checkout" if not git else git["commit"][:12] + (" (with local changes)" if git.get("dirty") else "")
        ident = ck.get("revision") or (ck.get("content_sha256_edges") or "")[:16]
        lines.append(f"  attnzoo {commit}; checkpoint {ck.get('path')} ({'revision' if ck.get('revision') else 'content hash'} {ident})")
    return lines


# ------------------------------------------------------------------------------ terminal


def _pct(x) -> str:
    return "   n/a" if x is None else f"{100 * x:6.2f}"


def render(report: dict, per_question_rows: bool = False) -> str:
    run = report["run"]
    d = run["decision"]
    lines = [
        f"run_eval {', '.join(run['tasks'])}: {run['model']} [{run['architecture']}]",
        f"  device {run['device']['device']} ({run['device'].get('name', '')}), dtype {run['dtype']}",
        f"  policy: prefill {d['prefill_backend']}, decode {d['decode_backend']}, page size {d['page_size']}",
    ]
    for key in ("prefill_backend", "decode_backend", "page_size"):
        src = d["sources"].get(key, {})
        why = src.get("detail", "")
        if src.get("reason"):
            why += f" ({src['reason']})"
        lines.append(f"    {key.replace('_', ' ')}: {why}")
    v = run["versions"]
    lines.append("  versions: " + ", ".join(f"{k} {v[k]}" for k in v))
    s = run["settings"]
    lines.append(f"  settings: limit {s.get('limit')}, {s.get('num_fewshot')}-shot, chat template "
                 f"{'on' if s.get('apply_chat_template') else 'off'}, max new tokens {s.get('max_new_tokens')}, "
                 f"data {s.get('data_dir') or 'Hugging Face Hub'}")
    for task, t in run["tasks"].items():
        lines.append("")
        lines.append(f"  {task}: {t['num_questions']} questions")
        lines.append(f"    {'filter':20} {'accuracy %':>10} {'± stderr':>9} {'invalid %':>10}")
        for flt, m in t["metrics"].items():
            metric = next((k for k in BINARY_METRICS if k in m), next((k for k in m if not k.endswith("_stderr") and k != "invalid_rate"), None))
            acc = m.get(metric) if metric else None
            se = m.get(f"{metric}_stderr") if metric else None
            lines.append(f"    {flt:20} {_pct(acc):>10} {_pct(se):>9} {_pct(m.get('invalid_rate')):>10}")
        if per_question_rows:
            filters = list(t["metrics"])
            lines.append(f"    {'doc':>5}  " + "  ".join(f"{f[:18]:>18} ok" for f in filters) + "  tokens finish")
            for r in t["per_question"]:
                cells = "  ".join(f"{str(r['answers'].get(f))[:18]:>18} {'y' if r['correct'].get(f) else 'n':>2}" for f in filters)
                lines.append(f"    {r['doc_id']:>5}  {cells}  {r.get('output_tokens', ''):>6} {r.get('finish_reason', '')}")
    tm = run["timing"]
    tps = tm["output_tokens_per_s"]
    lines.append("")
    lines.append(f"  wall latency {tm['wall_s']:.1f} s (generation {tm['generation_s']:.1f} s), output tokens "
                 f"{tm['output_tokens']}, output throughput {'n/a' if tps is None else f'{tps:.1f}'} tok/s")
    lines += render_performance(run)
    cmp = report.get("comparison")
    if cmp:
        a, b = cmp["a"], cmp["b"]
        lines.append("")
        lines.append(f"  comparison: A = {a['prefill_backend']}/{a['decode_backend']} page {a['page_size']}  vs  "
                     f"B = {b['prefill_backend']}/{b['decode_backend']} page {b['page_size']} ({b.get('label')})")
        lines.append(f"    {'task,filter':28} {'acc A %':>8} {'acc B %':>8} {'B-A %':>7} {'95% CI %':>17} "
                     f"{'A only':>6} {'B only':>6} {'McNemar p':>10} {'same answer':>12}")
        for m in cmp["metrics"]:
            ci = f"[{100 * m['ci95'][0]:+.1f}, {100 * m['ci95'][1]:+.1f}]"
            lines.append(f"    {m['task'] + ',' + m['filter']:28} {100 * m['accuracy_a']:8.2f} {100 * m['accuracy_b']:8.2f} "
                         f"{100 * m['difference']:+7.2f} {ci:>17} {m['only_a']:6d} {m['only_b']:6d} {m['mcnemar_p']:10.4f} "
                         f"{m['answers_agree']:>5}/{m['n']:<6}")
        lines.append(f"    accuracy: {cmp['accuracy_verdict']} (exact McNemar, alpha {cmp['alpha']}, "
                     f"p < {cmp['per_test_threshold']:.4g} per test after Bonferroni)")
        sp = (cmp.get("speed") or {}).get("output_tokens_per_s") or {}
        if sp.get("b_over_a") is not None:
            where = "" if cmp["speed"].get("same_device") else " (different devices: the ratio compares them too)"
            lines.append(f"    speed: B/A = {sp['b_over_a']:.2f}x output throughput ({sp['a']:.1f} vs {sp['b']:.1f} tok/s)"
                         + "".join(f", {k.split('_')[0]} {v['b_over_a']:.2f}x" for k, v in cmp["speed"].items()
                                   if k in ("prefill_tokens_per_s", "decode_tokens_per_s") and v.get("b_over_a"))
                         + where)
        lines += _render_tokens(cmp, per_question_rows)
        if "run_b" in report:
            tb = report["run_b"]["timing"]
            tps_b = tb["output_tokens_per_s"]
            lines.append(f"    B: wall latency {tb['wall_s']:.1f} s (generation {tb['generation_s']:.1f} s), output tokens "
                         f"{tb['output_tokens']}, output throughput {'n/a' if tps_b is None else f'{tps_b:.1f}'} tok/s")
    return "\n".join(lines)


def _render_tokens(cmp: dict, per_question_rows: bool) -> list[str]:
    tl = cmp["token_level"]
    tf = tl["teacher_forced"]
    fd = tl["first_divergence"]
    lines = [f"    token level: identical generations {tl['identical_generations']}/{tl['questions']} "
             f"({100 * tl['identical_rate']:.1f}%), extracted answer changed on {tl['answers_changed']}"]
    if fd["diverged"]:
        lines.append(f"      first differing token: min {fd['min']}, p10 {fd['p10']}, median {fd['median']}, "
                     f"p90 {fd['p90']}, max {fd['max']} (over {fd['diverged']} diverging generations)")
    if tf["tokens"]:
        lines.append(f"      teacher-forced on A's tokens ({tf['questions']} questions, {tf['tokens']} positions): "
                     f"B top-1 = A's token {100 * tf['top1_agreement_b']:.2f}% (A itself {100 * tf['top1_agreement_a']:.2f}%), "
                     f"KL(A||B) mean {tf['kl_mean']:.3g} max {tf['kl_max']:.3g} nats")
    if tf.get("note"):
        lines.append(f"      teacher forcing: {tf['note']}")
    lines.append(f"    verdict: {cmp['verdict']} ({cmp['verdict_reason']})")
    if per_question_rows:
        lines.append(f"    {'task':10} {'doc':>5} {'same':>5} {'1st diff':>8} {'answer':>7} {'top1 B %':>9} {'KL mean':>9} {'KL max':>9}")
        for task, rows in cmp["per_question"].items():
            for r in rows:
                t = r["teacher_forced"] or {}
                top1 = "" if t.get("top1_agreement_b") is None else f"{100 * t['top1_agreement_b']:.1f}"
                kl = "" if t.get("kl_mean") is None else f"{t['kl_mean']:.2e}"
                klm = "" if not t else f"{t['kl_max']:.2e}"
                lines.append(f"    {task[:10]:10} {r['doc_id']:>5} {'y' if r['identical'] else 'n':>5} "
                             f"{'' if r['first_divergence'] is None else r['first_divergence']:>8} "
                             f"{'same' if r['answers_same'] else 'CHANGED':>7} {top1:>9} {kl:>9} {klm:>9}")
    return lines


def write_chart(report: dict, path) -> str | None:
    from attnzoo.evals.chart import write_chart as chart

    return chart(report, path, _write_atomically)


def _write_atomically(path, write) -> None:
    """``write(binary file)`` into a temporary file beside ``path``, renamed over it once complete: a failed
    write (full disk, folder removed) leaves no truncated file and keeps a previous one."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
