"""The default KV cache size on a GPU: the cache takes 85% of the memory free after the weights, unless one
engine step needs more than the other 15%. What a step needs is measured by running one (vLLM's profile
run): ``max_batch_tokens`` prompt tokens (one prompt, or several where the context is shorter) on a pool of
just their pages, then the LM head and a softmax over as many rows as requests may run. A model whose
prefill activations outgrow the 15% (DeepSeek-V4-Flash on an 80 GB card) got a cache that left too little,
and its first large prefill ran out of memory. Under tensor parallelism the cache keeps the plain 85%: the
ranks would have to run the measured step together."""
from __future__ import annotations

import torch

from attnzoo.engine.sampling import SamplingParams

DEFAULT_FRACTION = 0.85
# Beside a step's own peak: the decode CUDA graphs' private pools (with the outputs of those captured while
# generating, cuda_graph.DEFAULT_MAX_ON_DEMAND_BYTES at most), cuBLAS workspaces, allocator slack, and the
# cascade GEMM pass's score chunk (cascade_gemm.CHUNK_SCORE_BYTES; the measured step runs without cascade).
# Not the piecewise graphs' pool (opt-in): about one step of their largest bucket's activations, beside this.
HEADROOM = 1 << 30
STEP_MARGIN = 1.25  # a step of many requests' tokens allocates somewhat more metadata than one prompt's


def step_peak_bytes(engine, lengths: list[int], logits_rows: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes allocated at the peak of one prefill step of prompts of ``lengths`` on ``engine``, plus those at the peak of
    ``logits_rows`` rows of logits with their softmax, each above what was allocated before it (the pool, the
    weights). Summed: with overlap, a step's logits are still held while the next step runs its forward."""
    dev = engine.device

    def peak_of(run) -> int:
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        run()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base

    def logits():
        with torch.inference_mode():
            rows = torch.zeros(logits_rows, hidden, dtype=dtype, device=dev)
            # float32, as the sampler's softmax reads them (compute_logits keeps the LM head's dtype)
            engine.model.compute_logits(rows).float().softmax(dim=-1)

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prefill = peak_of(lambda: engine.generate([[0] * n for n in lengths], [params] * len(lengths)))
    return prefill + peak_of(logits)


def default_kv_bytes(free: int, step_peak: int) -> int:
    """The KV cache's bytes by default: ``DEFAULT_FRACTION`` of ``free``, less what a step of ``step_peak``
    bytes (with its margin and the headroom) would not find in the rest."""
    return min(int(free * DEFAULT_FRACTION), free - int(STEP_MARGIN * step_peak) - HEADROOM)
