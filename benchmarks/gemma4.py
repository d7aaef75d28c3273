"""One decode step and one prefill of a Gemma-4-31B-shaped model on one GPU, per attention backend.

    python benchmarks/gemma4.py [--backends torch,triton,...] [--layers 12] [--batches 1,16]
                                [--context 4096] [--prefill 4096] [--out FILE.json]

The model is google/gemma-4-31B-it's text model (hidden 5376, 32 query heads; sliding layers: 16 KV
heads x 256, window 1024; global layers every 6th: 4 KV heads x 512, values from the key projection;
vocab 262144) with random bf16 weights created on the GPU through ``load_model(load_format="random")``,
so no checkpoint is needed. ``--layers N`` keeps the first N layers of the 5-sliding : 1-global pattern
(the last layer is always global, as in transformers) so that weights plus KV cache fit: the full 60
layers need about 58 GB of weights and 0.9 MB of KV per token.

Rows, per backend:
  decode   one DECODE step of the whole model (backend planning, every layer, final norm, logits of the
           batch's rows) for ``batch`` requests that each have ``context`` tokens cached. The pool
           holds zeros: kernels do not branch on values, and no prefill is needed to time decode.
  prefill  one EXTEND step of a ``--prefill``-token prompt on an empty cache (logits of its last row).
Before timing, each backend's hidden states on a small prefill + decode are compared with the torch
reference backend on the same weights and pool (bf16 relative error <= 2e-2 expected); a backend that
cannot run here is reported with the reason. Times are CUDA-event medians of ``--iters`` runs after
``--warmup`` runs. The table prints to stdout; JSON (device, versions, shape, checks, rows) goes to
``--out``.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import RESULTS, gpu_slug, time_cuda, write_result  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.attention.backends import backend_names, get_backend_class  # noqa: E402
from attnzoo.attention.layer import ForwardContext  # noqa: E402
from attnzoo.attention.metadata import build_metadata  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402

SOURCE = "google/gemma-4-31B-it text_config"
GEMMA4_31B = dict(
    vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
    num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
    sliding_window=1024, final_logit_softcapping=30.0, hidden_size_per_layer_input=0, max_position_embeddings=262144,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def write_config(directory: Path, layers: int) -> dict:
    from transformers import Gemma4TextConfig

    fields = dict(GEMMA4_31B, num_hidden_layers=layers,
                  layer_types=["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                               for i in range(layers)])
    cfg = Gemma4TextConfig(**fields, architectures=["Gemma4ForCausalLM"], dtype="bfloat16")
    cfg.save_pretrained(directory)
    return fields


def step(llm, ids: list[int], prefix_lens, q_lens, tables, backends=None) -> torch.Tensor:
    """One engine step through public pieces: metadata, backend planning, model, logits of last rows."""
    pre, dec = backends or (llm.engine.prefill_backend, llm.engine.decode_backend)
    meta = build_metadata(prefix_lens=prefix_lens, q_lens=q_lens, block_tables=tables,
                          page_size=llm.pool.page_size, device=llm.device)
    ctx = ForwardContext(meta, llm.pool, pre, dec)  # plans the step on the step's backend
    hidden = llm.model(torch.tensor(ids, device=llm.device), meta.positions, ctx)
    return hidden, llm.model.compute_logits(hidden[meta.last_token_rows])


def check_against_torch(llm, name: str) -> dict:
    """Hidden states of a 2-request prefill and a decode step, this backend vs the torch reference."""
    if name == "torch":
        return {"backend": name, "status": "reference"}
    ref = get_backend_class("torch")(llm.pool)
    alloc, ps = llm.engine.allocator, llm.pool.page_size
    lens = [300, 1500]  # the longer one crosses the 1024-token sliding window
    tables = [alloc.alloc(-(-(n + 1) // ps)) for n in lens]
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config_vocab_size
    prompt = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]
    errs = {}
    try:
        with torch.inference_mode():
            for phase, args in (("prefill", ([t for p in prompt for t in p], [0, 0], lens)),
                                ("decode", ([7, 11], lens, [1, 1]))):
                got, _ = step(llm, args[0], args[1], args[2], tables)
                want, _ = step(llm, args[0], args[1], args[2], tables, backends=(ref, ref))
                errs[phase] = float((got.float() - want.float()).norm() / want.float().norm())
                if not torch.isfinite(got).all():
                    errs[phase] = float("nan")
    finally:
        for t in tables:
            alloc.free(t)
    ok = all(e <= 2e-2 for e in errs.values())
    return {"backend": name, "status": "ok" if ok else "MISMATCH", "rel_err": errs}


def bench_backend(cfg_dir: Path, name: str, args) -> tuple[dict, list[dict]]:
    # Page rounding costs each request up to one page (at most 128 tokens) beyond its length.
    kv_tokens = max(max(args.batches) * (args.context + 1 + 128), args.prefill + 128, 2 * (1501 + 128))
    # One page group: the steps here are built by hand over one block table per request.
    llm = attnzoo.load_model(cfg_dir, backend=name, load_format="random", dtype="bfloat16", device="cuda",
                             kv_cache_tokens=kv_tokens, window_kv_fraction=None)
    info = llm.info()
    check = check_against_torch(llm, name)
    rows = []
    alloc, ps = llm.engine.allocator, llm.pool.page_size
    gen = torch.Generator().manual_seed(1)
    vocab = llm.config_vocab_size
    with torch.inference_mode():
        for batch in args.batches:
            tables = [alloc.alloc(-(-(args.context + 1) // ps)) for _ in range(batch)]
            ids = torch.randint(3, vocab, (batch,), generator=gen).tolist()
            times = time_cuda(lambda: step(llm, ids, [args.context] * batch, [1] * batch, tables),
                              warmup=args.warmup, iters=args.iters, samples=True)
            for t in tables:
                alloc.free(t)
            rows.append(_row(name, "decode", batch, args.context, batch, times))
        table = alloc.alloc(-(-args.prefill // ps))
        ids = torch.randint(3, vocab, (args.prefill,), generator=gen).tolist()
        times = time_cuda(lambda: step(llm, ids, [0], [args.prefill], [table]), warmup=1,
                          iters=max(3, args.iters // 3), samples=True)
        alloc.free(table)
        rows.append(_row(name, "prefill", 1, args.prefill, args.prefill, times))
    check.update(prefill_backend=info["prefill_backend"], decode_backend=info["decode_backend"],
                 page_size=info["page_size"], kv_bytes_per_token=info["kv_bytes_per_token"])
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return check, rows


def _row(backend, phase, batch, context, tokens, times):
    med = statistics.median(times)
    return {"backend": backend, "phase": phase, "batch": batch, "context": context, "median_ms": med,
            "min_ms": min(times), "tokens_per_s": tokens / med * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=",".join(backend_names()), help="comma-separated (default: all registered)")
    ap.add_argument("--layers", type=int, default=12, help="model depth (60 = the full model)")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=4096, help="cached tokens per request in the decode step")
    ap.add_argument("--prefill", type=int, default=4096, help="prompt length of the prefill step")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/gemma4_<gpu>.json)")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    if args.layers < 1 or args.context < 1 or args.prefill < 1 or min(args.batches) < 1:
        ap.error("--layers, --context, --prefill and --batches must be positive")
    gpu = torch.cuda.get_device_name()
    out = args.out or RESULTS / f"gemma4_{gpu_slug()}.json"

    checks, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        shape = write_config(Path(tmp), args.layers)
        for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
            try:
                check, r = bench_backend(Path(tmp), name, args)
            except (AttnzooError, ImportError) as e:  # not runnable here: report why, time the others
                check, r = {"backend": name, "status": "skipped", "reason": str(e)}, []
                gc.collect()
                torch.cuda.empty_cache()
            checks.append(check)
            rows.extend(r)
            print(f"[{name}] {check['status']}" + (f": {check.get('reason') or check.get('rel_err')}"
                                                   if check["status"] != "reference" else ""), flush=True)

    result = {
        "benchmark": "gemma4", "model_shape": SOURCE, "shape": shape, "layers": args.layers,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "checks": checks, "rows": rows,
    }
    out = write_result(out, result)
    print(f"\nGemma-4-31B shape, {args.layers} layers, bf16, {gpu}")
    print(f"{'backend':<12} {'phase':<8} {'batch':>5} {'context':>7} {'median ms':>10} {'min ms':>8} {'tok/s':>10}")
    for r in rows:
        print(f"{r['backend']:<12} {r['phase']:<8} {r['batch']:>5} {r['context']:>7} {r['median_ms']:>10.2f} "
              f"{r['min_ms']:>8.2f} {r['tokens_per_s']:>10.0f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
