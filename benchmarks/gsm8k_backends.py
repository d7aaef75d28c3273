"""GSM8K on the embedded SmolLM2-135M-Instruct (GGUF) for every runnable backend, bf16 and fp8 KV, each
compared with one reference run by run_eval's paired accuracy test and token-level evidence.

One process, one command: the reference (A, default: the torch oracle, bf16 KV) generates once and is
saved; each configuration (B) then generates and is compared with it as ``run_eval --compare-to <saved
reference>`` would (accuracy with McNemar, identical generations, first divergence); last, every B is
teacher-forced on A's tokens at once, A and all B's loaded together and stepped in lockstep, so A's
logits are computed once (top-1 agreement and KL(A||B) over all of A's output tokens, and the final
verdict). Every report, chart and the summary table are written as soon as they change (after each
configuration, and after each wave of teacher-forced questions), so a run stopped midway keeps what
finished; until teacher forcing has run over every question, a row's verdict is provisional (its
``teacher_forced_note`` says how far it got). Progress lines carry the elapsed time.

    python benchmarks/gsm8k_backends.py --data-dir ../shared/data/gsm8k --out benchmarks/results/gsm8k_backends_smollm2_h200
    python benchmarks/gsm8k_backends.py ... --limit 100        # a quick look
    python benchmarks/gsm8k_backends.py ... --configs triton,flashinfer+fp8_e4m3 --reuse-reference   # more rows, same A

Files: ``<out>.json`` / ``<out>.md`` (summary), ``<out>_ref_<reference>.json`` (run A), and per
configuration ``<out>_<config>.json`` / ``.png`` (run_eval's report and chart). With --reuse-reference
the saved reference run is used as is and the rows are merged into the existing summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attnzoo.attention.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402
from attnzoo.evals import run_eval  # noqa: E402

BACKENDS = ("torch", "triton", "flashinfer", "trtllm_mha")
KV_DTYPES = tuple(KV_CACHE_DTYPES)


def _runnable(backend: str, kv: str, gpu: str) -> str | None:
    """None when the policy accepts (backend, kv dtype) for SmolLM2 here, else why not."""
    from attnzoo.policy import Overrides, resolve
    from attnzoo.models import loader

    config = loader.load_config(loader.resolve_source(None))
    try:
        resolve(config, gpu=gpu, overrides=Overrides(backend=backend, kv_cache_dtype=kv, dtype="bfloat16",
                                                      page_size=_page_size(backend)))
    except AttnzooError as e:
        return str(e)
    return None


def _page_size(backend: str) -> int | None:
    return 16 if backend == "trtllm_mha" else None


def parse_configs(text: str | None, reference: str) -> list[tuple[str, str]]:
    """"triton,flashinfer+fp8_e4m3" -> [(backend, kv dtype)]; None: every backend with every KV dtype
    (bf16 ones first), less the reference itself."""
    if text is None:
        return [(b, kv) for kv in KV_DTYPES for b in BACKENDS if (b, kv) != (reference, "auto")]
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        backend, _, kv = item.partition("+")
        if backend not in BACKENDS or (kv or "auto") not in KV_DTYPES:
            raise SystemExit(f"--configs: {item!r} is not BACKEND[+KV_DTYPE] with BACKEND in {', '.join(BACKENDS)} "
                             f"and KV_DTYPE in {', '.join(KV_DTYPES)}")
        out.append((backend, kv or "auto"))
    return out


def config_name(backend: str, kv: str) -> str:
    return backend if kv == "auto" else f"{backend}+{kv}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="folder with GSM8K train.jsonl and test.jsonl")
    p.add_argument("--out", required=True, help="output prefix (folder/name): <out>.md, <out>.json, <out>_<config>.json/.png")
    p.add_argument("--limit", type=int, default=None, help="first N questions (default: all 1319)")
    p.add_argument("--reference", default="torch", help="backend of run A (bf16 KV)")
    p.add_argument("--configs", default=None, metavar="B[+KV],...",
                   help="configurations B, in order, e.g. triton,flashinfer,trtllm_mha,flashinfer+fp8_e4m3 "
                        "(default: every backend with every KV dtype, bf16 first)")
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--logit-compare-limit", type=int, default=None, metavar="N",
                   help="teacher-force the first N questions (default: all on a GPU, run_eval's CPU default on a CPU)")
    p.add_argument("--reuse-reference", action="store_true",
                   help="use the reference report saved by an earlier run and merge rows into its summary")
    args = p.parse_args()
    configs = parse_configs(args.configs, args.reference)

    import torch

    from attnzoo.policy import detect_gpu
    from attnzoo.evals.report import compare_runs, write_chart

    t_start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    gpu = detect_gpu()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["gsm8k", "--data-dir", args.data_dir, "--num-fewshot", str(args.num_fewshot)]
    if args.limit:
        common += ["--limit", str(args.limit)]
    if not torch.cuda.is_available():
        common += ["--device", "cpu"]
    eval_args = run_eval.build_parser().parse_args(common)

    ref_path = out.parent / f"{out.name}_ref_{args.reference}.json"
    summary_path = out.with_suffix(".json")
    prompts: dict = {}  # (task, doc_id) -> prompt token ids, from whichever run of this process has them
    if args.reuse_reference and ref_path.is_file():
        ref = json.loads(ref_path.read_text())
        say(f"reference: reusing {ref_path}")
    else:
        say(f"reference: {args.reference}, bf16 KV -> {ref_path}")
        seqs: dict = {}
        ref = run_eval.run(run_eval.build_parser().parse_args(common + ["--backend", args.reference, "--output",
                                                                         str(ref_path)]), sequences=seqs)
        prompts.update({k: p for k, (p, _) in seqs.items()})
        say(f"reference done: {ref['run']['timing']['output_tokens_per_s']:.0f} output tok/s")
    rows = [{"config": f"{args.reference} (reference)", **_acc(ref["run"])}]
    skipped = []
    if args.reuse_reference and summary_path.is_file():
        old = json.loads(summary_path.read_text())
        rows += [r for r in old["rows"] if r["config"] != rows[0]["config"]]
        skipped += old["skipped"]

    def write_summary() -> None:
        summary = {"gpu": gpu, "reference": args.reference, "limit": args.limit, "rows": rows, "skipped": skipped,
                   "versions": ref["run"]["versions"], "device": ref["run"]["device"],
                   "elapsed_s": time.perf_counter() - t_start}
        run_eval.write_report(summary_path, summary)
        out.with_suffix(".md").write_text(_table(summary))

    def set_row(name: str, rep: dict, note: str | None = None) -> None:
        nonlocal rows, skipped
        row = {"config": name, **_acc(rep["run"]), **_cmp(rep["comparison"])}
        if note:
            row["teacher_forced_note"] = note
        rows = [r for r in rows if r["config"] != name] + [row]
        skipped = [sk for sk in skipped if sk["config"] != name]

    on_gpu = torch.cuda.is_available()
    limit = args.logit_compare_limit if args.logit_compare_limit is not None else (
        1 << 62 if on_gpu else run_eval.CPU_LOGIT_COMPARE_LIMIT)
    pending = ("pending: runs once every configuration has generated (the verdict may change)" if limit
               else "off (--logit-compare-limit 0)")

    # ---- generation: each B once, compared with A on its tokens (teacher forcing comes after all of them)
    done: dict[str, tuple[dict, Path, Path]] = {}  # name -> (report, json path, png path)
    backends: dict[str, run_eval.Backends] = {}
    for backend, kv in configs:
        name = config_name(backend, kv)
        why = _runnable(backend, kv, gpu)
        if why:
            skipped = [sk for sk in skipped if sk["config"] != name] + [{"config": name, "why": why}]
            say(f"{name}: skipped ({why})")
            write_summary()
            continue
        say(f"{name}: generating, compared with the reference")
        json_path, png_path = out.parent / f"{out.name}_{name}.json", out.parent / f"{out.name}_{name}.png"
        argv = common + ["--backend", backend, "--kv-cache-dtype", kv, "--compare-to", str(ref_path),
                         "--output", str(json_path), "--plot", str(png_path), "--logit-compare-limit", "0"]
        if _page_size(backend):
            argv += ["--page-size", str(_page_size(backend))]
        seqs = {}
        try:
            rep = run_eval.run(run_eval.build_parser().parse_args(argv), sequences=seqs)
        except Exception as e:  # one configuration that fails (a kernel's JIT build, say) must not cost the others
            traceback.print_exc()
            skipped = [sk for sk in skipped if sk["config"] != name] + [{"config": name, "why": f"failed: {e!r}"}]
            say(f"{name}: failed ({e!r})")
            write_summary()
            continue
        if not prompts:
            prompts.update({k: p for k, (p, _) in seqs.items()})
        done[name] = (rep, json_path, png_path)
        backends[name] = run_eval.Backends(backend, None, None, _page_size(backend), kv)
        set_row(name, rep, note=pending)
        write_summary()
        tl = rep["comparison"]["token_level"]
        say(f"{name} done: {rep['run']['timing']['output_tokens_per_s']:.0f} output tok/s, "
            f"{tl['identical_generations']}/{tl['questions']} generations identical, {tl['answers_changed']} answers changed")

    # ---- teacher forcing: A once, every B in lockstep; reports rewritten after each wave of questions
    if done and limit:
        names = list(done)
        say(f"teacher forcing: A ({args.reference}) and {', '.join(names)} in lockstep")
        saved_a = ref["run"]

        def update(pairs: list[tuple], final: bool) -> None:
            for name, (forced, note) in zip(names, pairs):
                rep, json_path, png_path = done[name]
                rep["comparison"] = compare_runs(saved_a, rep["run"], alpha=eval_args.alpha, forced=forced,
                                                 forced_note=note)
                rep["comparison"]["a"]["label"] = f"saved report {ref_path} ({saved_a.get('label')})"
                if final:  # the chart's title names the verdict; the rest of it does not change
                    why_not = write_chart(rep, png_path)
                    rep["chart"] = str(png_path) if why_not is None else f"not written: {why_not}"
                run_eval.write_report(json_path, rep)
                set_row(name, rep)
            write_summary()
            say(f"teacher forcing: {pairs[0][1]}" if pairs else "teacher forcing: nothing to compare")

        pairs = run_eval.teacher_force_many(
            eval_args, run_eval._saved_backends(saved_a), [backends[n] for n in names], run_eval._saved_outputs(saved_a),
            prompts, limit, on_wave=lambda pairs: update(pairs, final=False))
        update(pairs, final=True)
    write_summary()
    say("done")
    print(_table(json.loads(summary_path.read_text())))
    return 0


def _acc(run: dict) -> dict:
    m = run["tasks"]["gsm8k"]["metrics"]
    return {"strict": m["strict-match"]["exact_match"], "flexible": m["flexible-extract"]["exact_match"],
            "tok_s": run["timing"]["output_tokens_per_s"], "kv_bytes_per_token": run["decision"].get("kv_bytes_per_token"),
            "decode": run["decision"]["decode_backend"], "prefill_kernel": run["decision"]["kernels"].get("prefill")}


def _cmp(c: dict) -> dict:
    tl, tf = c["token_level"], c["token_level"]["teacher_forced"]
    mc = {m["filter"]: m["mcnemar_p"] for m in c["metrics"]}
    return {"identical_rate": tl["identical_rate"], "median_first_divergence": tl["first_divergence"].get("median"),
            "answers_changed": tl["answers_changed"], "top1_b": tf.get("top1_agreement_b"),
            "top1_a": tf.get("top1_agreement_a"), "kl_mean": tf.get("kl_mean"), "kl_max": tf.get("kl_max"),
            "mcnemar_strict": mc.get("strict-match"), "mcnemar_flexible": mc.get("flexible-extract"),
            "accuracy_verdict": c["accuracy_verdict"], "verdict": c["verdict"], "teacher_forced_note": tf.get("note")}


def _table(s: dict) -> str:
    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    lines = [f"GSM8K, SmolLM2-135M-Instruct (GGUF), {s['device'].get('name')}, "
             f"{s['limit'] or 'all'} questions; A = {s['reference']} with a bf16 KV cache",
             "", "| config | strict % | flexible % | tok/s | KV B/token | identical gen. % | median 1st diff | "
             "answers changed | top-1 B % (A %) | KL mean | KL max | McNemar p (strict/flex) | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in s["rows"]:
        lines.append(
            f"| {r['config']} | {100 * r['strict']:.2f} | {100 * r['flexible']:.2f} | {f(r['tok_s'], '.0f')} | "
            f"{r['kv_bytes_per_token']} | {f(r.get('identical_rate') and 100 * r['identical_rate'], '.1f')} | "
            f"{f(r.get('median_first_divergence'), 'd')} | {f(r.get('answers_changed'), 'd')} | "
            + (f"{100 * r['top1_b']:.2f} ({100 * r['top1_a']:.2f})" if r.get("top1_b") is not None else "")
            + f" | {f(r.get('kl_mean'), '.2e')} | {f(r.get('kl_max'), '.2e')} | "
            f"{f(r.get('mcnemar_strict'), '.3f')}/{f(r.get('mcnemar_flexible'), '.3f')} | {r.get('verdict', '')} |")
    lines.append("")
    lines += [f"teacher forcing, {r['config']}: {r['teacher_forced_note']}" for r in s["rows"] if r.get("teacher_forced_note")]
    for sk in s["skipped"]:
        lines.append(f"\nskipped {sk['config']}: {sk['why']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
