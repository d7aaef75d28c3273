"""``run_eval``'s command line and the checks of its numbers and paths, all made before any weights are read."""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

from attnzoo.attention.kv_cache import KV_CACHE_DTYPES
from attnzoo.errors import EvalError

DESCRIPTION = """Evaluate a model with lm-evaluation-harness through attnzoo's engine.
Example: run_eval gsm8k --data-dir ../shared/data/gsm8k --limit 50
         run_eval gsm8k --limit 5 --compare-kv-cache-dtype fp8_e4m3 --plot cmp.png   # CPU: fp32 vs fp8 KV
         run_eval gsm8k --backend triton --compare-to torch --limit 200 --output report.json   # GPU"""
# Teacher forcing replays every compared question through both backends: all of them on a GPU, a few
# on a CPU (where one SmolLM2 question costs seconds per backend). --logit-compare-limit overrides.
CPU_LOGIT_COMPARE_LIMIT = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_eval", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", help="lm-eval task name (gsm8k, or any other lm-eval task)")
    p.add_argument("--model", default=None, help="checkpoint dir, hub id or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, help="attention backend for prefill and decode")
    p.add_argument("--prefill-backend", default=None)
    p.add_argument("--decode-backend", default=None)
    p.add_argument("--page-size", type=int, default=None, help="KV-cache page size (default: the policy's)")
    p.add_argument("--policy", default=None, metavar="FILE", help="user policy file (same schema as the shipped table)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split the model over N GPUs (default: 1, or WORLD_SIZE under torchrun, where rank 0 reports)")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="N replicas of the model (each --tensor-parallel-size ranks), the questions split between them; "
                        "the report does not depend on N (under torchrun: WORLD_SIZE = N x tensor-parallel size)")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N questions")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's, 5 for gsm8k)")
    p.add_argument("--apply-chat-template", action="store_true", help="format prompts with the tokenizer's chat template")
    p.add_argument("--data-dir", default=None, help="folder with train.jsonl and test.jsonl: run gsm8k offline from them")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generation limit per question (default: the task's, else 256)")
    p.add_argument("--compare-to", default=None, metavar="B2",
                   help="a second backend to run on the same questions, or a report JSON saved by --output")
    p.add_argument("--compare-page-size", type=int, default=None, help="page size for the --compare-to backend")
    p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                   help="what the KV cache stores (auto: the model dtype)")
    p.add_argument("--k-scale", type=float, default=1.0, help="fp8 KV: per-tensor key scale (default 1.0, as vLLM's)")
    p.add_argument("--v-scale", type=float, default=1.0, help="fp8 KV: per-tensor value scale (default 1.0)")
    p.add_argument("--compare-kv-cache-dtype", default=None, choices=tuple(KV_CACHE_DTYPES),
                   help="KV cache dtype of run B (default: run A's); without --compare-to, B uses A's backends")
    p.add_argument("--logit-compare-limit", type=int, default=None, metavar="N",
                   help="teacher-force the first N compared questions through both backends (KL, top-1); "
                        f"default: all on a GPU, {CPU_LOGIT_COMPARE_LIMIT} on a CPU; 0: off")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="with a comparison: chart accuracy with 95%% intervals and first-divergence positions")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the comparison (default 0.05)")
    p.add_argument("--output", default=None, metavar="FILE.json", help="write the report (with per-question records) here")
    p.add_argument("--per-question", action="store_true", help="also print one line per question")
    p.add_argument("--lm-eval-output", default=None, metavar="DIR",
                   help="also write lm-eval's own results_*.json and samples_*.jsonl files under DIR")
    p.add_argument("--wave-size", type=int, default=None,
                   help="questions handed to the engine per call (default: all at once)")
    return p


# ------------------------------------------------------------------------------ validation


def check_output_path(path: str, flag: str = "--output") -> Path:
    """``path`` as a file this run can create or replace (checked by creating a file beside it)."""
    out = Path(path).expanduser()
    if out.is_dir():
        example = "report.json" if flag == "--output" else "comparison.png"
        raise EvalError(f"{flag} {path!r} is a directory", fix=f"give a file name, e.g. {example}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise EvalError(f"{flag} {path!r}: the folder {str(parent)!r} does not exist", fix="create it first, or pick another path")
    # os.access says yes to root even on read-only mounts; creating a file is the real test.
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".run_eval-", delete=True):
            pass
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(str(out))
    except OSError as e:
        raise EvalError(f"{flag} {path!r} is not writable ({e.strerror or e})", fix="pick a path you can write to") from None
    return out


def _check_numbers(args) -> None:
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be at least 1, got {args.limit}", fix="pass --limit N with N >= 1, or leave it out to run every question")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise EvalError(f"--num-fewshot must be >= 0, got {args.num_fewshot}", fix="pass --num-fewshot 0 or more")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}", fix="pass a positive number")
    if args.wave_size is not None and args.wave_size < 1:
        raise EvalError(f"--wave-size must be at least 1, got {args.wave_size}", fix="pass a positive number")
    for flag, value in (("--k-scale", args.k_scale), ("--v-scale", args.v_scale)):
        if not 0 < value < float("inf"):  # NaN fails too
            raise EvalError(f"{flag} must be a positive finite number, got {value}", fix=f"pass {flag} 1.0 (the default)")
    if not 0 < args.alpha < 1:
        raise EvalError(f"--alpha must be between 0 and 1, got {args.alpha}", fix="pass e.g. --alpha 0.05")
    if args.backend and (args.prefill_backend or args.decode_backend):
        raise EvalError("--backend cannot be combined with --prefill-backend/--decode-backend",
                        fix="use --backend B for both phases, or --prefill-backend B1 --decode-backend B2")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise EvalError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}",
                        fix="pass a positive number")
    if args.data_parallel_size is not None and args.data_parallel_size < 1:
        raise EvalError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}",
                        fix="pass a positive number")
    if (args.data_parallel_size or 1) > 1 and (args.compare_to is not None or args.compare_kv_cache_dtype is not None):
        raise EvalError("--data-parallel-size > 1 runs one evaluation; comparisons (--compare-to, "
                        "--compare-kv-cache-dtype) teacher-force on one replica",
                        fix="drop --data-parallel-size for a comparison, or compare two saved reports with --compare-to")
    if args.compare_page_size is not None and args.compare_to is None:
        raise EvalError("--compare-page-size needs --compare-to", fix="add --compare-to BACKEND")
    if args.logit_compare_limit is not None and args.logit_compare_limit < 0:
        raise EvalError(f"--logit-compare-limit must be >= 0, got {args.logit_compare_limit}", fix="pass 0 to turn it off")
    if args.plot and args.compare_to is None and args.compare_kv_cache_dtype is None:
        raise EvalError("--plot charts a comparison", fix="add --compare-to B2 (or --compare-kv-cache-dtype)")
    if args.plot and not str(args.plot).endswith(".png"):
        raise EvalError(f"--plot {args.plot!r} is not a .png file name", fix="e.g. --plot comparison.png")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the run, not after it
        raise EvalError("--plot needs matplotlib, which is not installed", fix="pip install matplotlib, or drop --plot")
