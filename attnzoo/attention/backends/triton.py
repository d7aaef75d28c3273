"""The ``triton`` backend: our own paged extend and decode kernels (``attnzoo/attention/kernels``).

Portable wherever Triton runs (any CUDA GPU with bf16 for bf16 models; the CPU through Triton's
interpreter with ``TRITON_INTERPRET=1``, for tests). Supports MHA/GQA/MQA and absorbed MLA (MQA with
values inside the key), head dims up to 1024 (q/k and v may differ), page sizes 1..128, sliding
windows, logit soft-capping, attention sinks, a custom scale, float16/bfloat16/float32.

Per step, ``prepare`` records the host-side facts the launches need (longest context, longest extend) in
its plan (``TritonPlan``), so that no layer syncs with the device; per layer, the decode split count is plain integer arithmetic
and the split-K scratch is allocated once per step and shape, then shared by every layer of that shape.

CUDA graphs (decode): the kernels read ``meta.seq_lens`` and ``meta.block_tables`` on the device, so a
replay only needs the engine's static metadata buffers refilled. The split count is a launch constant
baked into the graph: under ``prepare_graph`` it depends only on the batch size and the longest context
the graph was sized for (``init_graph_state``), and the scratch lives on the backend, not the step.

Cascade (``supports_cascade``): when a DECODE step's requests share leading pages
(``meta.shared_prefix_len``), a layer without a sliding window reads those pages once per KV head for
the whole batch (``cascade_decode_attention``) and each request's own pages as usual. Cascade decode steps
are captured too (``supports_cascade_graph``): the prefix length is a launch argument, so it is the graph's
key; the split counts then follow from the bucket and the graphs' longest context, as in plain graphs.
EXTEND steps cascade in MLA layers at enough token x head rows (``extend.gemm_cascade``): the shared prefix as
two GEMMs for every new token, then the extend kernel over each request's own keys, merged as it writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnzoo.attention.backends.base import AttentionBackend, StepPlan
from attnzoo.attention.backends.capabilities import ALL_DTYPES, FP8_KV, BackendCapabilities
from attnzoo.attention.backends.gpus import ANY_CUDA, Kernel, gpu_set
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.errors import BackendError


def _import_kernels():
    try:
        from attnzoo.attention.kernels import decode, decode_launch, extend
    except ImportError as e:  # triton missing or broken
        raise BackendError(
            f"the triton backend cannot import triton ({e})",
            fix="pip install 'attnzoo[triton]', or choose backend='torch'",
        ) from e
    return decode, decode_launch, extend


@dataclass
class TritonPlan(StepPlan):
    """Host facts the launches need, so that no layer syncs with the device, and the step's scratch."""

    max_seq_len: int  # host: the longest KV length of the step
    max_q_len: int  # host: the longest extend of the step
    num_reqs: int
    graph_max_kv_len: int | None = None  # set under CUDA graphs: splits depend on this, not the step
    # Split-K decode scratch, device, float32, allocated once per step and shape, shared by the layers:
    # (batch, heads, splits, v_dim) -> (partial [b, h, s, dv], lse [b, h, s]). Graph steps use the backend's.
    scratch: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_INTERPRETER = "CPU runs the Triton interpreter: for tests only, very slow"
_NO_FP8 = "Triton has no fp8 e4m3 conversions before SM89"


class TritonBackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="triton",
        description="attnzoo's own Triton paged extend/decode kernels (split-K decode)",
        kinds=frozenset({"mha", "mla"}),
        prefill=(
            Kernel("triton extend", ANY_CUDA, no_fp8_kv_gpus=gpu_set("sm80"), note=_NO_FP8),
            Kernel("triton extend (interpreter)", gpu_set("cpu"), requires_env=("TRITON_INTERPRET", "1"),
                   note=_INTERPRETER),
        ),
        decode=(
            Kernel("triton split-K decode", ANY_CUDA, no_fp8_kv_gpus=gpu_set("sm80"), note=_NO_FP8),
            Kernel("triton split-K decode (interpreter)", gpu_set("cpu"), requires_env=("TRITON_INTERPRET", "1"),
                   note=_INTERPRETER),
        ),
        # The kernels tile any width up to 1024 (attention/kernels/common.py MAX_HEAD_DIM); tuned
        # for 64..512 and MLA's 576/512.
        max_head_dim=1024,
        kv_dtypes=ALL_DTYPES | FP8_KV,
        sliding_window=True,
        logit_softcap=True,
        attention_sinks=True,  # in extend, decode (split-K: in the merge) and cascade decode (in the merge)
        module="triton",
        extra="triton",
        cuda_graph=True,
        cascade=True,
        notes=("tuned for head dims 64..512 (MHA) and 576/512 (MLA); smaller dims run padded",),
    )
    fix = "use backend='torch' on CPU (or set TRITON_INTERPRET=1 before importing attnzoo, for tests)"
    supports_cascade_graph = True
    splits_mixed_steps = True
    captures_mixed_steps = True  # launches read device metadata only; extend's grid is sized by the plan's max_q_len
    strided_query = True  # every kernel addresses q through its strides
    cascade_extend_scope = ("MLA layers: their shared prefix as GEMMs, from cascade_gemm.EXTEND_MIN_ROWS "
                            "(token, head) rows")
    cascade_shared_pass = ("the shared prefix by cuDNN's attention (9.3+, NVIDIA GPUs) in steps captured as CUDA "
                           "graphs from cascade_sdpa.MIN_ROWS (request, head) rows of 16-bit layers with keys and "
                           "values of one width, a power of two up to 128; as GEMMs from cascade_gemm.MIN_ROWS rows "
                           "of MLA layers; else by the Triton kernel")

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.require_pool()
        self._decode_mod, self._launch_mod, self._extend_mod = _import_kernels()
        if pool.device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
        else:
            self._num_sms = 4  # the interpreter: small grids, but still exercise the split-K path
        self._graph_max_kv_len: int | None = None
        # Extend steps cascade in MLA layers only (their shared prefix as GEMMs, gemm_cascade): claimed where the
        # pool has a layer that qualifies on a GPU; steps below the row floor are still marked, and run plainly.
        gemm = self._extend_mod.cascade_gemm
        self.supports_cascade_extend = pool.device.type == "cuda" and any(
            s is not None and not s.sliding_window and s.shared_from is None and gemm.layer_qualifies(
                pool.dtype, pool.kv_dtype, s.head_dim, s.num_kv_heads, s.v_from_k, pool.k_scale, pool.v_scale)
            for s in pool.specs)
        self._graph_scratch: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- per step ----
    def prepare(self, meta: BatchMetadata) -> TritonPlan:
        return TritonPlan(max_seq_len=max(meta.seq_lens_cpu), max_q_len=max(meta.q_lens_cpu), num_reqs=meta.num_reqs)

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph_max_kv_len = max_pages_per_req * self.pool.page_size
        self._graph_scratch.clear()

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> TritonPlan:
        if self._graph_max_kv_len is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        plan = self.prepare(meta)
        plan.graph_max_kv_len = self._graph_max_kv_len
        return plan

    def cascade_graph_key(self, meta: BatchMetadata) -> int:
        return meta.shared_prefix_len  # baked into the launches (kv_skip, shared_len) and the split counts

    def warm_up(self, layers) -> None:
        """Kernels only large steps choose, which the engine's two-prompt warm-up never reaches, once per layer
        shape that qualifies: MLA's GEMM cascade (``extend.warm_up_cascade``) and the copies around the cuDNN
        shared pass of a captured decode step (``cascade_sdpa.warm_up``)."""
        seen = set()
        for layer in layers:
            k_cache, v_cache = self.pool.k(layer.layer_id), self.pool.v(layer.layer_id)
            key = (layer.num_heads, tuple(k_cache.shape[1:]), v_cache.shape[-1], layer.sinks is None)
            if layer.sliding_window or layer.logit_softcap or key in seen:
                continue
            calls = self._decode_mod.cascade_sdpa.warm_up(k_cache, v_cache, layer.num_heads, scale=layer.scale,
                                                          k_scale=self.pool.k_scale, v_scale=self.pool.v_scale)
            if self.supports_cascade_extend:
                calls += self._extend_mod.warm_up_cascade(k_cache, v_cache, layer.num_heads, scale=layer.scale,
                                                          sinks=layer.sinks)
            if calls:
                seen.add(key)  # only a layer that qualified: one that did not must not hide one that does

    # ---- per layer ----
    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: TritonPlan, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        self.check_layer("prefill", layer)
        ext, lid = self._extend_mod, layer.layer_id
        k_cache, v_cache = self.pool.k(lid), self.pool.v(lid)
        shared = 0 if layer.sliding_window else meta.shared_prefix_len
        if shared and ext.gemm_cascade(q, k_cache, v_cache, shared, layer.logit_softcap, self.pool.k_scale,
                                       self.pool.v_scale):
            return ext.cascade_extend_attention(q, k_cache, v_cache, meta.block_tables, meta.q_indptr,
                                                meta.prefix_lens, shared_len=shared, max_q_len=plan.max_q_len,
                                                scale=layer.scale, sinks=layer.sinks, out=out)
        return ext.extend_attention(
            q, k_cache, v_cache, meta.block_tables_for(layer.sliding_window), meta.q_indptr,
            meta.prefix_lens,
            max_q_len=plan.max_q_len, scale=layer.scale,
            sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap, sinks=layer.sinks,
            k_scale=self.pool.k_scale, v_scale=self.pool.v_scale, out=out,
        )

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: TritonPlan) -> torch.Tensor:
        self.check_layer("decode", layer)
        dec, how = self._decode_mod, self._launch_mod
        lid = layer.layer_id
        k_cache, v_cache = self.pool.k(lid), self.pool.v(lid)
        batch, num_heads, head_dim = q.shape
        num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[-1]
        group = num_heads // num_kv_heads
        shared = 0 if layer.sliding_window else meta.shared_prefix_len
        kv_len = plan.graph_max_kv_len or plan.max_seq_len
        if layer.sliding_window:
            kv_len = min(kv_len, layer.sliding_window)
        splits = how.layer_kv_splits(batch=batch, heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     v_dim=v_dim, values_in_keys=v_cache.data_ptr() == k_cache.data_ptr(),
                                     dtype=k_cache.dtype, max_kv_len=kv_len - shared, num_sms=self._num_sms)
        kw = dict(scale=layer.scale, logit_softcap=layer.logit_softcap, sinks=layer.sinks, k_scale=self.pool.k_scale,
                  v_scale=self.pool.v_scale)
        if not shared:
            partial = lse = None
            if splits > 1:
                partial, lse = self._scratch(plan, batch, num_heads, splits, v_dim, q.device)
            return dec.decode_attention(q, k_cache, v_cache, meta.block_tables_for(layer.sliding_window), meta.seq_lens,
                                        sliding_window=layer.sliding_window, num_kv_splits=splits,
                                        partial=partial, lse=lse, **kw)
        # Stage 2 merges the suffix and shared splits together: their sum stays within its limit.
        splits = min(splits, how.MAX_KV_SPLITS - 1)
        graph = plan.graph_max_kv_len is not None
        if dec.shared_pass_kind(q, k_cache, v_cache, shared, layer.logit_softcap, kw["k_scale"], kw["v_scale"],
                                graph=graph) != "triton":
            shared_splits = 1  # the GEMM and cuDNN passes write the whole prefix's attention into one slot
        else:
            block_m = how.cascade_launch_config(head_dim, v_dim, k_cache.dtype)["BLOCK_M"]
            shared_splits = how.choose_num_shared_splits(
                batch=batch, num_kv_heads=num_kv_heads, group=group, shared_len=shared, num_sms=self._num_sms,
                block_m=block_m, max_splits=how.MAX_KV_SPLITS - splits,
            )
        partial, lse = self._scratch(plan, batch, num_heads, splits + shared_splits, v_dim, q.device)
        return dec.cascade_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                            shared_len=shared, num_kv_splits=splits,
                                            num_shared_splits=shared_splits, partial=partial, lse=lse, graph=graph,
                                            **kw)

    def _scratch(self, plan: TritonPlan, batch, heads, splits, v_dim, device):
        key = (batch, heads, splits, v_dim)
        # Graph replays write into the buffers captured at capture time: they must outlive the step.
        store = self._graph_scratch if plan.graph_max_kv_len is not None else plan.scratch
        if key not in store:
            store[key] = (
                torch.empty(batch, heads, splits, v_dim, dtype=torch.float32, device=device),
                torch.empty(batch, heads, splits, dtype=torch.float32, device=device),
            )
        return store[key]
