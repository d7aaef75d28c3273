"""Which Triton kernels compile during a measured run, after e2e.py's warm-up: each one is seconds of the run spent
compiling (and, online, a request waiting). Run it on a fresh machine (or with an empty ``TRITON_CACHE_DIR``):
a warm on-disk cache hides the compiles.

The e2e workload (GSM8K 8-shot prompts, random weights): load, ``e2e.warm_up`` (two prompts, then every prompt
behind a marker token), the measured generate; the Triton cache entries made during it are listed with the
second they appeared and the arguments their signature assumes divisible by 16 (integers; pointers 16-byte
aligned; an integer equal to 1 becomes a constant and leaves the signature, unlisted): a per-step value there (a block table's width, a top-k width) compiles a variant whenever it
changes class, and ``@triton.jit(do_not_specialize=[...])`` stops that.

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/mid_run_compiles.py --shape dsv4-flash --layers 4
"""
import argparse
import glob
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_result  # noqa: E402
from e2e import SHAPE_NAMES, load_prompts, make_config, timed_generate, warm_up  # noqa: E402

import attnzoo  # noqa: E402


def cache_dir() -> str:
    d = os.environ.get("TRITON_CACHE_DIR")
    if not d:
        raise SystemExit("set TRITON_CACHE_DIR to an empty directory: this script reads what Triton writes there")
    return d


def entries(d: str) -> dict[str, float]:
    """Compiled kernels in the cache: their metadata file -> its mtime."""
    return {p: os.path.getmtime(p) for p in glob.glob(f"{d}/*/*.json") if "__grp__" not in os.path.basename(p)}


def specialized_args(kernel_dir: str) -> list[str]:
    """The arguments a compiled variant assumed divisible by 16 (integers) or 16-byte aligned (pointers), from its
    Triton IR."""
    ttir = glob.glob(f"{kernel_dir}/*.ttir")
    if not ttir:
        return []
    text = Path(ttir[0]).read_text()
    i = text.find("tt.func")
    end = text.find(") attributes", i)
    sig = text[i:end if end > 0 else i + 8000]
    return re.findall(r"%(\w+): (?:i32|i64|!tt\.ptr<\w+>) \{tt\.divisibility = 16", sig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=1319)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--load-kwargs", default="{}", help="extra load_model keywords as JSON")
    ap.add_argument("--out", default=None, help="a JSON file for the list")
    args = ap.parse_args(argv)
    d = cache_dir()
    config, _ = make_config(args.shape, args.layers)
    prompts, _ = load_prompts(args.prompts)
    llm = attnzoo.load_model(config, load_format="random", dtype="bfloat16", device="cuda",
                             **json.loads(args.load_kwargs))
    at_load = entries(d)
    threshold, llm.engine.cascade_min_saved_tokens = llm.engine.cascade_min_saved_tokens, 1  # as e2e.py's warm-up
    warm_up(llm, prompts)
    llm.engine.cascade_min_saved_tokens = threshold
    warmed = entries(d)
    _, wall, t0 = timed_generate(llm, prompts, args.new_tokens)
    start = time.time() - (time.perf_counter() - t0)  # the measured run's start on the files' clock
    after = entries(d)
    new = sorted(set(after) - set(warmed), key=after.get)
    rows = [{"kernel": Path(p).stem, "at_s": round(after[p] - start, 2),
             "divisible_by_16": specialized_args(os.path.dirname(p))} for p in new]
    print(f"{args.shape}: {len(at_load)} kernels compiled by load_model, {len(set(warmed) - set(at_load))} in the "
          f"warm-up, {len(new)} during the measured run ({wall:.2f} s)")
    for r in rows:
        print(f"  +{r['at_s']:6.2f} s  {r['kernel']:32s} args assumed divisible by 16: {r['divisible_by_16']}")
    if args.out:  # with the device, versions and source hash (common.run_meta)
        write_result(args.out, {"shape": args.shape, "layers": args.layers, "wall_s": wall,
                                "compiled_at_load": len(at_load), "compiled_in_measured_run": rows})


if __name__ == "__main__":
    main()
