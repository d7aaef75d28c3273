"""GSM8K on the embedded SmolLM2-135M-Instruct (GGUF) for every runnable backend, bf16 and fp8 KV, each
compared with one reference run by run_eval's paired accuracy test and token-level evidence.

The reference (A, default: the torch oracle, bf16 KV) runs once and is saved; every other
configuration (B) runs through ``run_eval --compare-to <saved reference>``: accuracy with McNemar,
identical generations, first divergence, teacher-forced top-1 agreement and KL(A||B) over all of A's
output tokens, and the verdict. Writes one report JSON and one chart per configuration, and a summary
table (``<out>.md``, ``<out>.json``).

    python benchmarks/gsm8k_backends.py --data-dir ../shared/data/gsm8k --out benchmarks/results/gsm8k_backends_smollm2_h200
    python benchmarks/gsm8k_backends.py ... --limit 100        # a quick look
    python benchmarks/gsm8k_backends.py ... --backends triton --reuse-reference   # one more row, same A

With --reuse-reference the saved reference run is used as is and the rows are merged into the existing
summary, so the configurations can be run in several shorter commands.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attnzoo.attention.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402
from attnzoo.evals import run_eval  # noqa: E402

BACKENDS = ("torch", "triton", "flashinfer", "trtllm_mha")
KV_DTYPES = tuple(KV_CACHE_DTYPES)


def _runnable(backend: str, kv: str, gpu: str) -> str | None:
    """None when the policy accepts (backend, kv dtype) for SmolLM2 here, else why not."""
    from attnzoo.defaults import Overrides, resolve
    from attnzoo.models import loader

    config = loader.load_config(loader.resolve_source(None))
    try:
        resolve(config, gpu=gpu, overrides=Overrides(backend=backend, kv_cache_dtype=kv, dtype="bfloat16",
                                                      page_size=16 if backend == "trtllm_mha" else None))
    except AttnzooError as e:
        return str(e)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="folder with GSM8K train.jsonl and test.jsonl")
    p.add_argument("--out", required=True, help="output prefix (folder/name): <out>.md, <out>.json, <out>_<config>.json/.png")
    p.add_argument("--limit", type=int, default=None, help="first N questions (default: all 1319)")
    p.add_argument("--reference", default="torch", help="backend of run A (bf16 KV)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--reuse-reference", action="store_true",
                   help="use the reference report saved by an earlier run and merge rows into its summary")
    args = p.parse_args()

    import torch

    from attnzoo.defaults import detect_gpu

    gpu = detect_gpu()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["gsm8k", "--data-dir", args.data_dir, "--num-fewshot", str(args.num_fewshot)]
    if args.limit:
        common += ["--limit", str(args.limit)]
    if not torch.cuda.is_available():
        common += ["--device", "cpu"]

    def run(argv: list[str]) -> dict:
        t0 = time.perf_counter()
        rep = run_eval.run(run_eval.build_parser().parse_args(argv))
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
        return rep

    ref_path = out.parent / f"{out.name}_ref_{args.reference}.json"
    summary_path = out.with_suffix(".json")
    if args.reuse_reference and ref_path.is_file():
        ref = json.loads(ref_path.read_text())
        print(f"reference: reusing {ref_path}", flush=True)
    else:
        print(f"reference: {args.reference}, bf16 KV -> {ref_path}", flush=True)
        ref = run(common + ["--backend", args.reference, "--output", str(ref_path)])
    rows = [{"config": f"{args.reference} (reference)", **_acc(ref["run"])}]
    skipped = []
    if args.reuse_reference and summary_path.is_file():
        old = json.loads(summary_path.read_text())
        rows += [r for r in old["rows"] if r["config"] != rows[0]["config"]]
        skipped += old["skipped"]
    for backend in args.backends.split(","):
        for kv in KV_DTYPES:
            if (backend, kv) == (args.reference, "auto"):
                continue
            why = _runnable(backend, kv, gpu)
            name = backend if kv == "auto" else f"{backend}+{kv}"
            if why:
                skipped.append({"config": name, "why": why})
                print(f"{name}: skipped ({why})", flush=True)
                continue
            print(f"{name} vs the reference", flush=True)
            argv = common + ["--backend", backend, "--kv-cache-dtype", kv, "--compare-to", str(ref_path),
                             "--output", str(out.parent / f"{out.name}_{name}.json"),
                             "--plot", str(out.parent / f"{out.name}_{name}.png")]
            if backend == "trtllm_mha":
                argv += ["--page-size", "16"]
            rep = run(argv)
            rows = [r for r in rows if r["config"] != name] + [{"config": name, **_acc(rep["run"]), **_cmp(rep["comparison"])}]
            skipped = [sk for sk in skipped if sk["config"] != name]
    summary = {"gpu": gpu, "reference": args.reference, "limit": args.limit, "rows": rows, "skipped": skipped,
               "versions": ref["run"]["versions"], "device": ref["run"]["device"]}
    summary_path.write_text(json.dumps(summary, indent=1))
    out.with_suffix(".md").write_text(_table(summary))
    print(_table(summary))
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
            "accuracy_verdict": c["accuracy_verdict"], "verdict": c["verdict"]}


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
    for sk in s["skipped"]:
        lines.append(f"\nskipped {sk['config']}: {sk['why']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
