"""Write the cached reference for tests/test_evals.py: lm-eval's own ``hf`` model on gsm8k.

It runs lm-eval's stock Hugging Face model (transformers, ``from_pretrained(dir, gguf_file=...)``) on the
embedded SmolLM2-135M-Instruct GGUF, 5-shot, over the first N test questions read from local GSM8K
files, in float32 on CPU, one question at a time (batch size 1, so no padding enters the arithmetic),
and saves per-question answers in the same shape as run_eval's report records.

    python scripts/make_hf_gsm8k_reference.py --data-dir ../shared/data/gsm8k --limit 50 \
        --output tests/data/gsm8k_hf_reference.json

Slow on CPU (tens of minutes for 50 questions); rerun it only when the task, the data or lm-eval change.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="folder with GSM8K train.jsonl and test.jsonl")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--output", default="tests/data/gsm8k_hf_reference.json")
    args = p.parse_args(argv)

    import lm_eval

    from attnzoo.evals.report import per_question, task_metrics, versions
    from attnzoo.evals.tasks import check_data_dir, load_tasks
    from attnzoo.models.loader import resolve_source

    src = resolve_source(None)
    files = check_data_dir("gsm8k", args.data_dir)
    tm, loaded = load_tasks("gsm8k", files)
    t0 = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(src.directory), "gguf_file": src.gguf_file, "dtype": "float32", "device": "cpu"},
        tasks=list(loaded["tasks"].values()), num_fewshot=args.num_fewshot, limit=args.limit, batch_size=1,
        log_samples=True, task_manager=tm,
    )
    wall = time.perf_counter() - t0
    records = per_question(results["samples"]["gsm8k"])
    for r in records:
        r.pop("target", None)  # the gold solution text is in the data files; keep the reference small
    out = {
        "what": "lm-eval 'hf' model answers on gsm8k (reference for tests/test_evals.py)",
        "model": src.name,
        "gguf_file": src.gguf_file,
        "settings": {"limit": args.limit, "num_fewshot": args.num_fewshot, "dtype": "float32", "device": "cpu",
                     "batch_size": 1, "data_files": sorted(Path(f).name for f in files.values()),
                     "seeds": {k: results["config"].get(k) for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")}},
        "versions": versions(),
        "metrics": task_metrics(results["results"]["gsm8k"], records),
        "wall_s": wall,
        "per_question": records,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {args.output}: {len(records)} questions in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
