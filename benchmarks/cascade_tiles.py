"""The Triton cascade decode (``cascade_decode_attention``) with the shared pass's BLOCK_M narrowed to the
rows (request x group head) a batch has, as it was chosen until the tiles stopped depending on the batch,
against the fixed extend tile, on a Llama-3.1-8B-shaped layer (32 heads, 8 KV heads, head dim 128, bf16):
a shared prefix of 1312 tokens plus 100 of each request's own. Times are CUDA-event medians of whole calls
(three launches each), which are launch-bound at small batches.

    python benchmarks/cascade_tiles.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import time_cuda  # noqa: E402

from attnzoo.attention.kernels import decode as dec  # noqa: E402
from attnzoo.attention.kernels.extend import extend_launch_config  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE, SHARED, OWN = 32, 8, 128, 16, 1312, 100


def case(batch: int, device="cuda"):
    """(q, k cache, v cache, block tables, seq lens): every request's table starts with the shared pages."""
    shared = list(range(1, SHARED // PAGE + 1))
    own_pages = -(-(SHARED + OWN + 1) // PAGE) - len(shared)
    k = torch.randn(1 + len(shared) + batch * own_pages, KV_HEADS, PAGE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    first = 1 + len(shared)
    tables = [shared + list(range(first + b * own_pages, first + (b + 1) * own_pages)) for b in range(batch)]
    return (torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16), k, torch.randn_like(k),
            torch.tensor(tables, dtype=torch.int32, device=device),
            torch.full((batch,), SHARED + OWN + 1, dtype=torch.int32, device=device))


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    group = HEADS // KV_HEADS
    print(f"{torch.cuda.get_device_name()}: shared {SHARED} + own {OWN} tokens, us per call")
    for batch in (2, 4, 8, 16, 64, 256, 1319):
        q, k, v, tables, seq = case(batch)
        fixed = extend_launch_config(HEAD_DIM, HEAD_DIM, torch.bfloat16)
        narrowed = dict(fixed, BLOCK_M=min(fixed["BLOCK_M"], max(dec.MIN_TILE, dec.next_pow2(batch * group))))
        splits = min(dec.choose_num_kv_splits(batch=batch, num_kv_heads=KV_HEADS, group=group, max_kv_len=OWN + 1,
                                              num_sms=sms), dec.MAX_KV_SPLITS - 1)
        row, outs = [], []
        for name, cfg in (("narrowed", narrowed), ("fixed", fixed)):
            shared_splits = dec.choose_num_shared_splits(batch=batch, num_kv_heads=KV_HEADS, group=group,
                                                         shared_len=SHARED, num_sms=sms, block_m=cfg["BLOCK_M"],
                                                         max_splits=dec.MAX_KV_SPLITS - splits)
            fn = lambda: dec.cascade_decode_attention(  # noqa: E731
                q, k, v, tables, seq, shared_len=SHARED, scale=HEAD_DIM ** -0.5, num_kv_splits=splits,
                num_shared_splits=shared_splits, launch_config=cfg)
            outs.append(fn().float())
            row.append(f"{name} BLOCK_M {cfg['BLOCK_M']:3d}: {time_cuda(fn, warmup=5, iters=50) * 1000:6.1f}")
        print(f"batch {batch:5d}  " + "  ".join(row) + f"  max diff {(outs[0] - outs[1]).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
