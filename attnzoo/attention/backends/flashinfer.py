"""The ``flashinfer`` backend: FlashInfer's paged prefill/extend and decode plan/run wrappers.

Kernels (HND pages read in place, bf16/fp16, head dims 64/128/256/512, sliding window, soft-cap):

* extend: ``BatchPrefillWithPagedKVCacheWrapper``, causal with the queries aligned to the end of each
  request's KV range (a cached prefix then the new tokens). On SM90 it runs FlashInfer's FA3 kernels
  when q/k and v head dims are equal and at most 256 (FA3 prefill does not build for head dim 512);
  everywhere else, and for head dim 512, the FA2 kernels. ``prefill_kernel`` says which.
* decode: ``BatchDecodeWithPagedKVCacheWrapper`` (FA2). It uses the tensor-core kernels when a KV head
  serves >= 4 query heads (the rule SGLang applies; the CUDA-core kernel wins for small groups). FlashInfer
  0.7.2 has no FA3 decode kernel of its own: its decode wrapper with ``backend="fa3"`` runs the FA3 paged
  prefill kernel at one query per request, which ``decode_variant="fa3"`` selects for measurements; and
  layers whose v head dim differs from q/k run their one-token step through the prefill wrapper,
  since the decode wrapper needs them equal.

Cascade decode (``meta.shared_prefix_len`` > 0: every request starts with the same pages, e.g. a
few-shot prefix): the shared pages are read once for the whole batch by the prefill wrapper, all the
step's queries as one non-causal request over them; each request's remaining pages go through the
decode wrapper; ``merge_state`` combines the two partial results by their log-sum-exp. Layers whose
decode runs through the prefill wrapper keep the plain path.

Sliding-window layers cascade too (``fi_common.cascade_split``): the shared segment is the part of the
shared prefix inside every query's window (from the page the longest request's window starts in); each
request's rest is its pages from its own window start up to that segment, then its pages after the
prefix, planned with ``window_left`` lowered by the skipped gap, which keeps the mask exact. A step
whose longest request's window has moved past the prefix runs those layers plain. On the GSM8K shape
(1312 shared tokens, window 1024, contexts up to ~1820) the segment is ~500 tokens of each request's
1024-token window (arithmetic, not a measurement).

Cascade extend (an EXTEND step whose requests share leading cached pages: prompt chunks after a cached
few-shot prefix, beside decode rows): the same split, with the rest through the prefill wrapper, causal.
Every new token of the step comes after the shared pages and sees all of them, so the shared part is
non-causal. Without it each request re-reads the whole prefix through a 128-row query tile, which a
decode row (one query) fills to 1/128. The rest runs FA2, which packs a KV head's query heads into one
tile and sizes tiles to the rows (16 for a decode row): the rest is short KV ranges and few rows.

fp8 KV cache (``kv_cache_dtype="fp8_e4m3"``): both wrappers are planned with kv_data_type
float8_e4m3fn and run with the pool's k_scale/v_scale (FlashInfer folds k_scale into the softmax
scale and multiplies the output by v_scale); the queries stay in the model dtype. Prefill then runs
FA2: FlashInfer's FA3 kernels take fp8 only with fp8 queries.

CUDA graphs of decode steps, cascade ones included (``supports_cascade_graph``): bucket wrappers over
static buffers, re-planned before each replay (``flashinfer_plan.GraphState``, whose module says what a
graph bakes in).

Planning: ``prepare(meta)`` starts the step's ``FlashInferPlan`` (``flashinfer_plan.py``: its page
indices, one set per sliding-window size, built on first use) and plans one wrapper per distinct layer
signature (heads, KV heads, head dims, window, soft-cap, scale); every layer of that signature reuses it. The
backend learns the signatures from the layers it serves: on the first step each signature is planned
when its first layer runs, from then on ``prepare`` plans them all before the model runs.
"""
from __future__ import annotations

import torch

from attnzoo.attention.backends.base import AttentionBackend, PlanFence
from attnzoo.attention.backends.capabilities import FP8_KV, HALF, BackendCapabilities
from attnzoo.attention.backends.gpus import ANY_CUDA, Kernel, gpu_of, gpu_set
from attnzoo.attention.backends.fi_common import (
    CascadeSplit,
    LayerSignature,
    cascade_graph_key,
    cascade_split,
    check_page_size,
    graph_float_workspace_bytes,
    compute_capability,
    gap_quantum_pages,
    load_flashinfer,
    sm_name,
    split_kv_fits_workspace,
    workspace,
)
from attnzoo.attention.backends.flashinfer_plan import (
    CascadeRun,
    FlashInferPlan,
    GraphState,
    PageIndex,
    float_workspace,
)
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata, ForwardMode
from attnzoo.errors import BackendError

FA3_HEAD_DIMS = (64, 128, 256)
TENSOR_CORE_DECODE_MIN_GROUP = 4


class FlashInferBackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="flashinfer",
        description="FlashInfer paged prefill/decode wrappers (FA2 everywhere, FA3 prefill on SM90)",
        kinds=frozenset({"mha"}),
        prefill=(
            Kernel("FlashInfer FA3 prefill", gpu_set("sm90"), excluded_head_dims=frozenset({512}),
                   no_fp8_kv_gpus=gpu_set("sm90"),
                   note="FA3 prefill does not build for head dim 512, nor for an fp8 KV cache with bf16/fp16 queries"),
            Kernel("FlashInfer FA2 prefill", ANY_CUDA, no_fp8_kv_gpus=gpu_set("sm80"),
                   note="fp8 KV cache declared for SM89+ only"),
        ),
        decode=(Kernel("FlashInfer FA2 decode", ANY_CUDA, no_fp8_kv_gpus=gpu_set("sm80"),
                       note="fp8 KV cache declared for SM89+ only"),),
        head_dims=frozenset({64, 128, 256, 512}),
        v_head_dims=frozenset({64, 128, 256, 512}),
        dtypes=HALF,
        kv_dtypes=HALF | FP8_KV,
        sliding_window=True,
        logit_softcap=True,
        # FlashInfer 0.7.2.post1's wrappers take `sinks=` but hand it only to their trtllm-gen modules; FA2/FA3
        # apply sinks only when built as a JIT attention variant (jit/attention/variants.py), not wired here.
        # Cascade would also need the sink in the merge, not in each part (merge_state takes none).
        attention_sinks=False,
        module="flashinfer",
        extra="flashinfer",
        cuda_graph=True,
        cascade=True,
        notes=("decode layers whose v head dim differs from q/k run through the prefill wrapper",
               "cascade decode: the shared prefix through the prefill wrapper (all queries, not causal), "
               "the rest through the decode wrapper, merged by log-sum-exp (merge_state)"),
    )
    supports_cascade_extend = True
    supports_cascade_graph = True
    fix = "choose backend='triton' (any head dim up to 1024) or 'torch' (MLA models: 'flashinfer_mla')"

    def __init__(self, pool: KVPool, *, prefill_variant: str | None = None, decode_variant: str = "fa2",
                 overlap_cascade: bool = True):
        """``prefill_variant``: None picks per layer (FA3 on SM90 where it builds, else FA2); "fa2" or
        "fa3" forces one (for measurements; "fa3" needs SM90 and head dims <= 256). ``decode_variant``:
        "fa2" (the default, measured), or "fa3" (the FA3 paged kernel at one query per request; SM90,
        equal head dims <= 256; for measurements against the field's FA3 decode). ``overlap_cascade``:
        a cascade step runs each layer's shared part on a second stream beside its rest (the default);
        False runs them one after the other (for measurements). Planned steps read it. The FA2 shared part
        of a global layer overlaps the rest; a sliding layer's FA3 shared part does not start beside the decode
        grid (benchmarks/results/cascade_overlap_gemma4_nvidia_h200.txt)."""
        super().__init__(pool)
        self._fence = PlanFence(pool.device)
        self.overlap_cascade = overlap_cascade
        self._side: torch.cuda.Stream | None = None  # created with the first overlapped cascade step
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        self.gpu = gpu_of(self._cc)
        self.require_pool()
        if prefill_variant not in (None, "fa2", "fa3"):
            raise BackendError(f"unknown FlashInfer prefill variant {prefill_variant!r}", fix="use 'fa2', 'fa3' or None")
        if prefill_variant == "fa3" and self._cc[0] != 9:
            raise BackendError(
                f"FlashInfer's FA3 prefill runs on SM90 only; this GPU is {sm_name(self._cc)}",
                fix="use prefill_variant='fa2' or None",
            )
        if decode_variant not in ("fa2", "fa3"):
            raise BackendError(f"unknown FlashInfer decode variant {decode_variant!r}", fix="use 'fa2' or 'fa3'")
        if decode_variant == "fa3" and self._cc[0] != 9:
            raise BackendError(
                f"FlashInfer's FA3 kernels run on SM90 only; this GPU is {sm_name(self._cc)}",
                fix="use decode_variant='fa2'",
            )
        if decode_variant == "fa3" and pool.is_fp8:  # as for prefill: FA3 takes fp8 KV only with fp8 queries
            raise BackendError("FlashInfer's FA3 decode variant does not read an fp8 KV cache with "
                               f"{str(pool.dtype).removeprefix('torch.')} queries",
                               fix="use decode_variant='fa2' with kv_cache_dtype='fp8_e4m3'")
        self._prefill_variant = prefill_variant
        self._decode_variant = decode_variant
        self._prefill_wrappers: dict[LayerSignature, object] = {}
        self._decode_wrappers: dict[LayerSignature, object] = {}
        self._cascade_wrappers: dict[LayerSignature, tuple[object, object]] = {}
        self._cascade_extend_rest: dict[LayerSignature, object] = {}  # the rest's prefill wrappers
        self._known: dict[LayerSignature, None] = {}  # insertion-ordered set of signatures seen
        self._graph: GraphState | None = None  # set by init_graph_state

    # ---------------------------------------------------------------- kernel choice (reported)

    def prefill_kernel(self, head_dim: int, v_head_dim: int) -> str:
        """"fa3" or "fa2": which FlashInfer prefill kernels serve a layer with these head dims here."""
        fa3_fits = (self._cc[0] == 9 and head_dim == v_head_dim and head_dim in FA3_HEAD_DIMS
                    and not self.pool.is_fp8)
        if self._prefill_variant == "fa3":
            if not fa3_fits:
                raise BackendError(
                    f"FlashInfer's FA3 prefill does not serve head dims q/k {head_dim}, v {v_head_dim} "
                    f"(it builds for equal dims in {FA3_HEAD_DIMS}) or an fp8 KV cache with "
                    f"{str(self.pool.dtype).removeprefix('torch.')} queries",
                    fix="use prefill_variant='fa2' or None",
                )
            return "fa3"
        if self._prefill_variant == "fa2":
            return "fa2"
        return "fa3" if fa3_fits else "fa2"

    def decode_kernel(self, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int) -> str:
        if head_dim != v_head_dim:
            return f"{self.prefill_kernel(head_dim, v_head_dim)} prefill (q/k and v head dims differ)"
        if self._decode_variant == "fa3":
            if head_dim not in FA3_HEAD_DIMS:
                raise BackendError(f"FlashInfer's FA3 kernels do not build for head dim {head_dim}",
                                   fix="use decode_variant='fa2'")
            return "fa3 paged kernel at one query per request (decode_variant='fa3')"
        if num_heads // num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP:
            return "fa2 decode (tensor cores)"
        return "fa2 decode (CUDA cores)"

    def kernels_for(self, layer) -> dict[str, str]:
        """The kernels this backend runs for ``layer``, per phase, for reports and the Decision."""
        return {
            "prefill": f"FlashInfer {self.prefill_kernel(layer.head_dim, layer.v_head_dim)} paged prefill",
            "decode": "FlashInfer " + self.decode_kernel(layer.num_heads, layer.num_kv_heads,
                                                         layer.head_dim, layer.v_head_dim),
        }

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata, graph_bucket: int | None = None) -> FlashInferPlan:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        qo = torch.zeros(meta.num_reqs + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(meta.q_lens_cpu, dtype=torch.int32), 0, dtype=torch.int32, out=qo[1:])
        step = FlashInferPlan(mode=meta.mode, qo_indptr=qo,
                              shared_pages=meta.shared_prefix_len // meta.page_size, graph_bucket=graph_bucket)
        self._fence.wait()  # the wrappers' pinned page lists: the last plan's copies must have left them
        for sig in self._known:
            self._plan(meta, step, sig)
        self._fence.mark()
        return step

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph = GraphState(max_batch_size, max_pages_per_req, self.pool.device)
        # Graph plans size split-KV partials for the padded batch: 128 MiB overflows from a few hundred
        # requests up (Gemma 4's 512-wide global layers at 4096 need 0.8 GB), so grow it now, once.
        dev = self.pool.device
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        workspace(self.pool.device, "wrappers", graph_float_workspace_bytes(self.pool.specs, max_batch_size, sms))

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> FlashInferPlan:
        """Plan a captured decode step: the bucket's (``meta.num_reqs``) wrappers, built with
        ``use_cuda_graph=True`` over static index buffers that ``plan()`` refills with this step's lengths
        and pages before every replay; the graph holds their ``run()``. ``meta.shared_prefix_len`` > 0: a
        cascade graph's step, split with the graph's rounded gap (the split ``cascade_graph_key`` named)."""
        if self._graph is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        if not meta.is_decode:
            raise BackendError(f"{self.name} captures decode steps only", fix="run extend steps eagerly")
        return self.prepare(meta, graph_bucket=meta.num_reqs)

    def cascade_graph_key(self, meta: BatchMetadata) -> tuple:
        """What a cascade decode graph of this step bakes in beyond its bucket (``fi_common.cascade_graph_key``),
        over the sliding windows of the layers that cascade (those the decode wrapper serves)."""
        windows = sorted({sig.window for sig in self._known
                          if sig.window and not self._uses_prefill_wrapper(ForwardMode.DECODE, sig)})
        return cascade_graph_key(meta.seq_lens_cpu, meta.q_lens_cpu, meta.shared_prefix_len // meta.page_size,
                                 meta.page_size, windows)

    def _check_layer(self, sig: LayerSignature, layer, mode: ForwardMode) -> None:
        if layer is not None:  # a signature planned again by prepare() passed when its first layer ran
            self.check_layer("prefill" if mode is ForwardMode.EXTEND else "decode", layer)

    def _uses_prefill_wrapper(self, mode: ForwardMode, sig: LayerSignature) -> bool:
        return mode is ForwardMode.EXTEND or sig.head_dim != sig.v_head_dim

    def _plan(self, meta: BatchMetadata, step: FlashInferPlan, sig: LayerSignature, layer=None):
        self._check_layer(sig, layer, step.mode)
        extend = step.mode is ForwardMode.EXTEND
        split = None
        if step.shared_pages and (extend or not self._uses_prefill_wrapper(step.mode, sig)):
            split = self._split(meta, step, sig.window)
        if split is not None:
            bucket = step.graph_bucket
            if bucket is None:
                shared_wrappers, rest_wrappers = self._cascade_wrappers.setdefault(sig, ({}, {}))
            else:  # the rest's window_left is baked into the graph: one rest wrapper per value
                shared_wrappers = self._graph.prefill((bucket, "shared"))
                rest_wrappers = self._graph.decode((bucket, "rest", split.window_left))
            shared = PageIndex(
                kv_indptr=torch.tensor([0, split.gap_pages], dtype=torch.int32),
                kv_indices=meta.block_tables_for(sig.window)[0, split.shared_start:split.shared_end],
                last_page_len=torch.tensor([meta.page_size], dtype=torch.int32),
            )
            everyone = step.qo_indptr[[0, -1]]  # every query sees every shared key
            rest_idx = step.rest_index(meta, sig.window, split, self.pool.device)
            if extend:
                rest = self._plan_prefill(self._cascade_extend_rest, meta, sig, step.qo_indptr, rest_idx, causal=True,
                                          kernel=None if self._prefill_variant else "fa2",
                                          window_left=split.window_left)
            else:
                rest = self._plan_decode(rest_wrappers, meta, sig, rest_idx, window_left=split.window_left,
                                         graph_bucket=bucket)
            # The shared part keeps the layer's own window_left (the kernel variant its extend steps build):
            # with the shared segment no longer than window_left (cascade_split), it masks none of it.
            planned = CascadeRun(
                shared=self._plan_prefill(shared_wrappers, meta, sig, everyone, shared, causal=False,
                                          graph_bucket=bucket, shared_part=True),
                rest=rest, merge_state=self._fi.merge_state, side=self._side_stream(),
            )
        elif self._uses_prefill_wrapper(step.mode, sig):
            wrappers = self._prefill_wrappers if step.graph_bucket is None else self._graph.prefill(step.graph_bucket)
            planned = self._plan_prefill(wrappers, meta, sig, step.qo_indptr,
                                         step.page_index(meta, sig.window, self.pool.device), causal=True,
                                         graph_bucket=step.graph_bucket)
        else:
            wrappers = self._decode_wrappers if step.graph_bucket is None else self._graph.decode(step.graph_bucket)
            planned = self._plan_decode(wrappers, meta, sig, step.page_index(meta, sig.window, self.pool.device),
                                        graph_bucket=step.graph_bucket)
        step.planned[sig] = planned
        return planned

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The stream cascade shared parts run on (``overlap_cascade``; CUDA pools only). High priority, so
        that the scheduler may dispatch its few CTAs ahead of the rest's grid."""
        if not self.overlap_cascade or self.pool.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.pool.device, priority=-1)
        return self._side

    def _split(self, meta: BatchMetadata, step: FlashInferPlan, window: int | None) -> CascadeSplit | None:
        """The step's cascade split for one window size (None: the layer runs plain), computed once."""
        if window not in step.splits:
            # graph steps round the gap, as their key (cascade_graph_key) does
            quantum = gap_quantum_pages(window, meta.page_size) if window and step.graph_bucket is not None else 1
            step.splits[window] = cascade_split(meta.seq_lens_cpu, meta.q_lens_cpu, step.shared_pages,
                                                meta.page_size, window, quantum_pages=quantum)
        return step.splits[window]

    def _plan_options(self, sig: LayerSignature, window_left: int | None = None) -> dict:
        """The plan arguments the prefill and decode wrappers take alike (``window_left``: a cascade rest's)."""
        dtype = self.pool.dtype
        return dict(
            pos_encoding_mode="NONE",  # RoPE is applied by the model before the cache store
            sm_scale=sig.scale,
            window_left=sig.window_left if window_left is None else window_left,
            logits_soft_cap=sig.softcap or 0.0,
            q_data_type=dtype,
            kv_data_type=self.pool.kv_dtype,
            o_data_type=dtype,
            non_blocking=True,
        )

    def _plan_prefill(self, wrappers: dict, meta: BatchMetadata, sig: LayerSignature, qo_indptr: torch.Tensor,
                      idx: PageIndex, *, causal: bool, kernel: str | None = None, window_left: int | None = None,
                      graph_bucket: int | None = None, shared_part: bool = False):
        """``shared_part``: a cascade step's shared part (all queries in one request; its own float workspace,
        and in a graph its own buffers)."""
        wrapper = wrappers.get(sig)
        if wrapper is None:
            graph = {} if graph_bucket is None else (
                self._graph.shared_buffers(sig) if shared_part else self._graph.prefill_buffers(sig, graph_bucket))
            wrapper = wrappers[sig] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer=workspace(self.pool.device, float_workspace(shared_part)),
                kv_layout="HND",
                backend=kernel or self.prefill_kernel(sig.head_dim, sig.v_head_dim),
                **graph,
            )
            if graph:
                self._graph.share_int_workspace(sig, wrapper, shared=shared_part)
        # FlashInfer's graph-mode planner always splits the KV; for a shared part of many rows its float32
        # partials would outgrow its workspace, and those rows' tiles fill the GPU unsplit (fixed per wrapper).
        # Eager shared parts keep the same bound: their workspace is the fixed-size "cascade_shared".
        no_split = shared_part and not split_kv_fits_workspace(int(qo_indptr[-1]), sig.num_heads, sig.v_head_dim)
        wrapper.plan(
            qo_indptr=qo_indptr,
            paged_kv_indptr=idx.kv_indptr,
            paged_kv_indices=idx.kv_indices,
            paged_kv_last_page_len=idx.last_page_len,
            num_qo_heads=sig.num_heads,
            num_kv_heads=sig.num_kv_heads,
            head_dim_qk=sig.head_dim,
            head_dim_vo=sig.v_head_dim,
            page_size=meta.page_size,
            causal=causal,  # causal is bottom-right aligned: new tokens follow their request's cached prefix
            **self._plan_options(sig, window_left),
            **({"disable_split_kv": True} if no_split else {}),
        )
        return wrapper

    def _plan_decode(self, wrappers: dict, meta: BatchMetadata, sig: LayerSignature, idx: PageIndex,
                     window_left: int | None = None, graph_bucket: int | None = None):
        wrapper = wrappers.get(sig)
        if wrapper is None:
            self.decode_kernel(sig.num_heads, sig.num_kv_heads, sig.head_dim, sig.v_head_dim)  # checks fa3 dims
            fa3 = self._decode_variant == "fa3"
            graph = {} if graph_bucket is None else self._graph.decode_buffers(sig, graph_bucket)
            wrapper = wrappers[sig] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                float_workspace_buffer=workspace(self.pool.device, "wrappers"),
                kv_layout="HND",
                # FlashInfer's FA3 decode is its tensor-core (prefill-kernel) path.
                use_tensor_cores=fa3 or sig.group >= TENSOR_CORE_DECODE_MIN_GROUP,
                backend=self._decode_variant,
                **graph,
            )
            if graph:
                self._graph.share_int_workspace(sig, wrapper)
        wrapper.plan(
            indptr=idx.kv_indptr,
            indices=idx.kv_indices,
            last_page_len=idx.last_page_len,
            num_qo_heads=sig.num_heads,
            num_kv_heads=sig.num_kv_heads,
            head_dim=sig.head_dim,
            page_size=meta.page_size,
            is_causal=False,  # one query per request: it sees its whole KV range
            **self._plan_options(sig, window_left),
        )
        return wrapper

    # ---------------------------------------------------------------- per layer

    def _run(self, layer, q: torch.Tensor, meta: BatchMetadata, step: FlashInferPlan) -> torch.Tensor:
        sig = LayerSignature.of(layer)
        wrapper = step.planned.get(sig)
        if wrapper is None:
            wrapper = self._plan(meta, step, sig, layer)
            self._known[sig] = None
        lid = layer.layer_id
        # q: [num_tokens, heads, head_dim]; pages: HND [num_pages, kv_heads, page_size, dim], as planned.
        return wrapper.run(q=q, paged_kv_cache=(self.pool.k(lid), self.pool.v(lid)), **self._kv_scales())

    def _kv_scales(self) -> dict:
        """run() keywords for an fp8 pool (none otherwise: a scale of 1.0 would still cost a multiply)."""
        return {"k_scale": self.pool.k_scale, "v_scale": self.pool.v_scale} if self.pool.is_fp8 else {}

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: FlashInferPlan) -> torch.Tensor:
        return self._run(layer, q, meta, plan)

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: FlashInferPlan) -> torch.Tensor:
        return self._run(layer, q, meta, plan)
