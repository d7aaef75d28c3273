"""Fused elementwise ops and merged projections vs the torch reference, per op and per decode step.

Ops (attnzoo.layers.fused) at the decode shapes of Llama-3.1-8B, Gemma-4-31B, DeepSeek-V3 and
DeepSeek-V4-Flash's hyper-connections (bf16, 1024 tokens by default): the torch reference
(``fused.use("torch")``) against the Triton kernel, and the separate q/k/v and gate/up GEMMs against the
merged ones. ``--model`` also times whole decode steps of
the Llama-3.1-8B shape (random weights, batch = --tokens, CUDA graphs as the engine uses them) fused vs
unfused.

    python benchmarks/fused_ops.py [--tokens 1024] [--model] [--out benchmarks/results/fused_ops_<gpu>.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import time_cuda, write_result  # noqa: E402

from attnzoo.layers import fused  # noqa: E402
from attnzoo.models.common import RMSNorm  # noqa: E402

SHAPES = {
    # hidden, intermediate, q heads, kv heads, head dim, rope interleaved
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, False),
    "gemma-4-31b-global": (5376, 21504, 32, 4, 512, False),
    "deepseek-v3-rope": (7168, 18432, 128, 1, 64, True),
}


def bench(fn, iters: int = 100) -> float:
    """Median microseconds of fn() on the GPU."""
    return time_cuda(fn, warmup=10, iters=iters) * 1e3


def ops(shape: str, t: int) -> list[dict]:
    hidden, inter, qh, kh, d, interleaved = SHAPES[shape]
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(t, hidden, dtype=dt, device=dev)
    res = torch.randn(t, hidden, dtype=dt, device=dev)
    norm = RMSNorm(hidden).to(dev, dt)
    post = RMSNorm(hidden).to(dev, dt)
    gate_up = torch.randn(t, 2 * inter, dtype=dt, device=dev)
    q = torch.randn(t, qh, d, dtype=dt, device=dev)
    k = torch.randn(t, kh, d, dtype=dt, device=dev)
    ang = torch.randn(t, d // 2, device=dev)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    cases = {
        "rms_norm": lambda: fused.rms_norm(x, norm),
        "add_rms_norm": lambda: fused.add_rms_norm(x, res, norm),
        "postnorm_add_rms_norm": lambda: fused.add_rms_norm(x, res, norm, x_norm=post),
        "silu_and_mul" if shape != "gemma-4-31b-global" else "gelu_tanh_and_mul":
            lambda: fused.act_and_mul(gate_up, "silu" if shape != "gemma-4-31b-global" else "gelu_tanh"),
        "rope_qk": lambda: fused.rope(q, k, cos, sin, interleaved=interleaved),
    }
    rows = []
    for name, fn in cases.items():
        with fused.use("torch"):
            ref = bench(fn)
        got = bench(fn)
        rows.append(dict(shape=shape, tokens=t, op=name, torch_us=ref, fused_us=got, speedup=ref / got))
    # Merged projections: one GEMM instead of two (gate/up) or three (q/k/v).
    w_gate, w_up = (torch.randn(inter, hidden, dtype=dt, device=dev) * 0.01 for _ in range(2))
    w_gu = torch.cat([w_gate, w_up])
    ws = [torch.randn(n * d, hidden, dtype=dt, device=dev) * 0.01 for n in (qh, kh, kh)]
    w_qkv = torch.cat(ws)
    for name, sep, merged in (
        ("gate_up_gemm", lambda: (F.linear(x, w_gate), F.linear(x, w_up)), lambda: F.linear(x, w_gu)),
        ("qkv_gemm", lambda: [F.linear(x, w) for w in ws], lambda: F.linear(x, w_qkv)),
    ):
        a, b = bench(sep), bench(merged)
        rows.append(dict(shape=shape, tokens=t, op=name, torch_us=a, fused_us=b, speedup=a / b))
    return rows


def v4_ops(t: int) -> list[dict]:
    """DeepSeek-V4-Flash's hyper-connection ops (4 streams of 4096) and its RoPE (q's with the per-head norm, the
    output's un-rotation in place): the torch reference against the kernels."""
    n, hidden, dev = 4, 4096, "cuda"
    streams = torch.randn(t, n, hidden, dtype=torch.bfloat16, device=dev)
    out = torch.randn(t, hidden, dtype=torch.bfloat16, device=dev)
    fn = torch.randn((2 + n) * n, n * hidden, device=dev) * hidden**-0.5
    head_fn = torch.randn(n, n * hidden, device=dev) * hidden**-0.5
    mixes = fused.hc_project(streams, fn, 1e-6)
    scale, base = torch.ones(3, device=dev), torch.zeros((2 + n) * n, device=dev)
    pre, post, comb = fused.hc_weights(mixes, scale, base, n=n, iters=20, eps=1e-6)
    q = torch.randn(t, 64, 512, dtype=torch.bfloat16, device=dev)  # 64 heads of 512, 64 rotary channels
    f = torch.randn(t, 32, device=dev)
    cos, sin = f.cos(), f.sin()
    q_norm = RMSNorm(512, 1e-6, with_scale=False)
    cases = {
        "rope_tail_norm_q": lambda: fused.rope_tail(q, cos, sin, norm=q_norm),
        "rope_tail_in_place_o": lambda: fused.rope_tail(q, cos, -sin, in_place=True),
        "hc_project": lambda: fused.hc_project(streams, fn, 1e-6),
        "hc_project_head": lambda: fused.hc_project(streams, head_fn, 1e-6),
        "hc_weights": lambda: fused.hc_weights(mixes, scale, base, n=n, iters=20, eps=1e-6),
        "hc_collapse": lambda: fused.hc_collapse(streams, pre),
        "hc_mix": lambda: fused.hc_mix(streams, post, comb, out),
    }
    rows = []
    for name, fn_ in cases.items():
        with fused.use("torch"):
            ref = bench(fn_)
        got = bench(fn_)
        rows.append(dict(shape="deepseek-v4-flash", tokens=t, op=name, torch_us=ref, fused_us=got,
                         speedup=ref / got))
    return rows


def decode_steps(tokens: int, steps: int = 32) -> list[dict]:
    """Decode-step time of the Llama-3.1-8B shape at batch ``tokens``, fused vs unfused."""
    from e2e import LLAMA_8B
    from transformers import LlamaConfig

    import attnzoo

    cfg = LlamaConfig(**LLAMA_8B)
    cfg.architectures = ["LlamaForCausalLM"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (64,), generator=g).tolist() for _ in range(tokens)]
    rows = []
    for impl in ("torch", "triton"):
        with fused.use(impl):
            llm = attnzoo.load_model(cfg, load_format="random", dtype="bfloat16", device="cuda", max_running=tokens)
            llm.generate(prompts[:2], max_new_tokens=4, ignore_eos=True)  # compile, capture
            llm.generate(prompts, max_new_tokens=2, ignore_eos=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, max_new_tokens=1, ignore_eos=True)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompts, max_new_tokens=steps + 1, ignore_eos=True)
            torch.cuda.synchronize()
            step_ms = (time.perf_counter() - t0 - prefill) / steps * 1e3
            rows.append(dict(impl=impl, batch=tokens, decode_step_ms=step_ms, graphs=dict(llm.engine.graph_stats)))
            del llm
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--model", action="store_true", help="also time Llama-3.1-8B decode steps fused vs unfused")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = [r for s in SHAPES for r in ops(s, args.tokens)] + v4_ops(args.tokens)
    print(f"{gpu}, torch {torch.__version__}, bf16, {args.tokens} tokens")
    print(f"{'shape':<20} {'op':<24} {'torch us':>9} {'fused us':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['shape']:<20} {r['op']:<24} {r['torch_us']:9.1f} {r['fused_us']:9.1f} {r['speedup']:8.2f}")
    steps = decode_steps(args.tokens) if args.model else []
    for r in steps:
        print(f"Llama-3.1-8B decode step, batch {r['batch']}, {r['impl']}: {r['decode_step_ms']:.2f} ms {r['graphs']}")
    if args.out:
        write_result(args.out, {"ops": rows, "decode_steps": steps}, tokens=args.tokens)


if __name__ == "__main__":
    main()
