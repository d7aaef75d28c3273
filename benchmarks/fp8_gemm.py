"""Block-scaled FP8 GEMM (DeepSeek-V3 checkpoint format) vs bf16 GEMM on one GPU, for DeepSeek-V3 linear shapes.

    python benchmarks/fp8_gemm.py [--batches 1,64,512,4096] [--shapes q_a,q_b,kv_a,o,dense_gate_up,dense_down]
                                  [--output FILE.json]

Shapes (N, K) from deepseek-ai/DeepSeek-V3's config.json (hidden 7168, q_lora_rank 1536, kv_lora_rank
512, qk_rope 64, 128 heads of qk 192 / v 128, intermediate 18432, moe_intermediate 2048). The gate and
up projections of a dense MLP are one [2 x 18432, 7168] GEMM here, as a merged layer would run them.

Per (shape, M) the rows are:
  bf16          ``F.linear`` on the dequantized bf16 weight (cuBLAS).
  fp8_triton    act_quant + our Triton w8a8 block GEMM (what ``Fp8Linear`` runs off SM90 or when N/K are
                not multiples of 128); ``gemm_only`` is the GEMM without the activation quantization.
  fp8_scaled_mm act_quant (column-major scales) + ``torch._scaled_mm`` blockwise 1x128/128x128 (SM90 cuBLAS),
                when this torch/GPU has it.
Each path is first checked against the float32 reference of the same quantized operands (relative error
<= 1e-2). Times are CUDA-event medians with the L2 cache flushed before every run; TFLOP/s counts
2*M*N*K, GB/s counts weight + activation + output bytes (FP8 weights: 1 byte + scales). The JSON (device,
versions, rows) goes to ``--output`` (default ``benchmarks/results/fp8_gemm_<gpu>.json``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import RESULTS, gpu_slug, time_cuda, write_result  # noqa: E402

from attnzoo.layers import fp8  # noqa: E402
from attnzoo.roofline import copy_bandwidth  # noqa: E402

SHAPES = {  # name: (N, K)
    "q_a": (1536, 7168),
    "q_b": (128 * 192, 1536),
    "kv_a": (512 + 64, 7168),
    "o": (7168, 128 * 128),
    "dense_gate_up": (2 * 18432, 7168),
    "dense_down": (7168, 18432),
    "expert_gate_up": (2 * 2048, 7168),
    "expert_down": (7168, 2048),
}
DEFAULT_SHAPES = "q_a,q_b,kv_a,o,dense_gate_up,dense_down"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def bench_shape(name: str, n: int, k: int, batches: list[int], flush, warmup: int, iters: int) -> list[dict]:
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev) * 0.02
    w8, ws = fp8.quantize_weight(w)
    w_bf16 = fp8.dequantize(w8, ws, dtype=torch.bfloat16)
    del w
    scaled_mm_ok = fp8.choose_gemm(dev, n, k, torch.bfloat16) == fp8.GEMM_SCALED_MM
    ws_t = fp8._scaled_mm_weight_scale(ws) if scaled_mm_ok else None
    rows = []
    for m in batches:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        x8, xs = fp8.act_quant(x)
        ref = fp8.w8a8_block_matmul_reference(x8, xs, w8, ws)
        paths = {
            "bf16": (lambda: F.linear(x, w_bf16), None),
            "fp8_triton": (lambda: fp8.w8a8_block_matmul(*fp8.act_quant(x), w8, ws, out_dtype=torch.bfloat16),
                           lambda: fp8.w8a8_block_matmul(x8, xs, w8, ws, out_dtype=torch.bfloat16)),
        }
        if scaled_mm_ok:
            xs_cm = fp8.act_quant(x, column_major_scales=True)[1]
            paths["fp8_scaled_mm"] = (
                lambda: fp8._scaled_mm(*fp8.act_quant(x, column_major_scales=True), w8, ws_t, torch.bfloat16),
                lambda: fp8._scaled_mm(x8, xs_cm, w8, ws_t, torch.bfloat16))
        flops = 2 * m * n * k
        for path, (fn, gemm_only) in paths.items():
            err = rel_err(fn(), ref)
            row = {"shape": name, "n": n, "k": k, "m": m, "path": path, "rel_err_vs_fp8_reference": err}
            if path != "bf16" and err > 1e-2:
                row["error"] = f"relative error {err:.3g} > 1e-2: not timed"
                rows.append(row)
                continue
            ms = time_cuda(fn, warmup=warmup, iters=iters, flush=flush)
            wbytes = n * k * 2 if path == "bf16" else n * k + ws.numel() * 4
            nbytes = wbytes + m * k * 2 + m * n * 2
            row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9)
            if gemm_only is not None:
                row["gemm_only_ms"] = time_cuda(gemm_only, warmup=warmup, iters=iters, flush=flush)
            rows.append(row)
        base = next(r["ms"] for r in rows if r["shape"] == name and r["m"] == m and r["path"] == "bf16")
        for r in rows:
            if r["shape"] == name and r["m"] == m and "ms" in r:
                r["speedup_vs_bf16"] = base / r["ms"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"from: {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,64,512,4096")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if not fp8.fp8_gemm_supported(dev):
        print("this GPU has no FP8 tensor cores (SM89+ needed)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",") if b]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    print(f"{'shape':15} {'N':>6} {'K':>6} {'M':>5} {'path':14} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'x bf16':>7} {'gemm ms':>8}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for r in bench_shape(name, n, k, batches, flush, args.warmup, args.iters):
            rows.append(r)
            if "ms" in r:
                print(f"{name:15} {n:6} {k:6} {r['m']:5} {r['path']:14} {r['ms']:8.4f} {r['tflops']:8.1f} "
                      f"{r['gbps']:7.0f} {r['speedup_vs_bf16']:7.2f} {r.get('gemm_only_ms', float('nan')):8.4f}")
            else:
                print(f"{name:15} {n:6} {k:6} {r['m']:5} {r['path']:14} {r['error']}")
    out = write_result(args.output or RESULTS / f"fp8_gemm_{gpu_slug()}.json", {
        "copy_bandwidth_gbps": copy_bandwidth(dev), "source": "deepseek-ai/DeepSeek-V3 config.json", "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
