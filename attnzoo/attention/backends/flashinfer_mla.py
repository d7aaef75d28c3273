"""The ``flashinfer_mla`` backend: FlashInfer's ``BatchMLAPagedAttentionWrapper`` for absorbed MLA layers.

Our MLA pool keeps one entry per token, ``[latent (kv_lora_rank) | rope key (qk_rope_head_dim)]``, in
one buffer ``pool.k(layer)`` of shape [num_pages, 1, page_size, 576] for DeepSeek. The wrapper is given
that buffer as its *packed* KV cache (a [num_pages, page_size, 576] view, no copy); the FA2/FA3
kernels then read the latent and rope parts as two strided views of it. The absorbed query
[tokens, heads, 576] is passed packed the same way (q_nope = first 512 channels, q_pe = last 64). The
output is [tokens, heads, kv_lora_rank], the latent-space values the model projects back.

Kernels: FA3 on SM90, FA2 elsewhere (SM80+); ``variant`` forces one for measurements. Extend is
causal with queries aligned to the end of each request's KV range; decode has one query per request.
Planning is once per step in ``prepare`` per distinct (heads, dims, scale) signature, as in the
``flashinfer`` backend: learned from the first step's layers, planned up front afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnzoo.attention.backends.base import AttentionBackend
from attnzoo.attention.backends.capabilities import HALF, BackendCapabilities, Kernel, gpu_of, gpu_set
from attnzoo.attention.backends.fi_common import (
    LayerSignature,
    check_page_size,
    compute_capability,
    load_flashinfer,
    sm_name,
    workspace,
)
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata, ForwardMode
from attnzoo.errors import BackendError
from attnzoo.lazy import lazy_module

page_table = lazy_module("attnzoo.attention.kernels.page_table")  # Triton: imported on first use


@dataclass
class _Step:
    mode: ForwardMode
    metadata: object  # flashinfer.mla.MLAPlanMetadata (CSR form): host indptrs/lengths, device page ids
    planned: dict[LayerSignature, object] = field(default_factory=dict)


class FlashInferMLABackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="flashinfer_mla",
        description="FlashInfer BatchMLAPagedAttentionWrapper over the absorbed latent cache",
        kinds=frozenset({"mla"}),
        prefill=(
            Kernel("FlashInfer MLA FA3", gpu_set("sm90")),
            Kernel("FlashInfer MLA FA2", gpu_set("sm80", "sm89", "sm100", "sm103", "sm120")),
        ),
        decode=(
            Kernel("FlashInfer MLA FA3", gpu_set("sm90")),
            Kernel("FlashInfer MLA FA2", gpu_set("sm80", "sm89", "sm100", "sm103", "sm120")),
        ),
        mla_multiples=(128, 64),
        dtypes=HALF,
        kv_dtypes=HALF,
        module="flashinfer",
        extra="flashinfer",
        notes=("dense MLA only: sparse (NSA) layers need an NSA backend",),
    )
    fix = "choose backend='triton' or 'torch' for this MLA shape (MHA models: 'flashinfer'; NSA layers: an NSA backend)"

    def __init__(self, pool: KVPool, *, variant: str | None = None):
        super().__init__(pool)
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        self.gpu = gpu_of(self._cc)
        self.require_pool()
        if variant not in (None, "fa2", "fa3"):
            raise BackendError(f"unknown FlashInfer MLA variant {variant!r}", fix="use 'fa2', 'fa3' or None")
        if variant == "fa3" and self._cc[0] != 9:
            raise BackendError(f"FlashInfer's FA3 MLA kernels run on SM90 only; this GPU is {sm_name(self._cc)}",
                               fix="use variant='fa2' or None")
        self.variant = variant or ("fa3" if self._cc[0] == 9 else "fa2")
        self._wrappers: dict[LayerSignature, object] = {}
        self._known: dict[LayerSignature, None] = {}
        self._state_key = f"{self.name}:{id(self)}"

    def kernels_for(self, layer) -> dict[str, str]:
        k = f"FlashInfer MLA {self.variant} (BatchMLAPagedAttentionWrapper)"
        return {"prefill": k, "decode": k}

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata) -> None:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        ps = meta.page_size
        qo, kv = [0], [0]
        for q, s in zip(meta.q_lens_cpu, meta.seq_lens_cpu):
            qo.append(qo[-1] + q)
            kv.append(kv[-1] + -(-s // ps))
        kv_indptr = torch.tensor(kv, dtype=torch.int32)
        kv_indices = page_table.create_kv_indices(
            meta.block_tables, meta.seq_lens, kv_indptr.to(self.pool.device, non_blocking=True), ps, num_indices=kv[-1],
        )
        metadata = self._fi.MLAPlanMetadata.csr(
            qo_indptr=torch.tensor(qo, dtype=torch.int32),  # host copies: planning reads them without a sync
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len_arr=torch.tensor(meta.seq_lens_cpu, dtype=torch.int32),
        )
        step = _Step(mode=meta.mode, metadata=metadata)
        meta.backend_state[self._state_key] = step
        for sig in self._known:
            self._plan(meta, step, sig)

    def _step(self, meta: BatchMetadata) -> _Step:
        step = meta.backend_state.get(self._state_key)
        if step is None or step.mode is not meta.mode:
            self.prepare(meta)
            step = meta.backend_state[self._state_key]
        return step

    def _check_layer(self, layer, meta: BatchMetadata) -> None:
        self.check_layer("decode" if meta.is_decode else "prefill", layer)

    def _plan(self, meta: BatchMetadata, step: _Step, sig: LayerSignature):
        wrapper = self._wrappers.get(sig)
        if wrapper is None:
            wrapper = self._fi.BatchMLAPagedAttentionWrapper(
                float_workspace_buffer=workspace(self.pool.device, "wrappers"), backend=self.variant,
            )
            self._wrappers[sig] = wrapper
        wrapper.plan(
            metadata=step.metadata,
            num_heads=sig.num_heads,
            head_dim_ckv=sig.v_head_dim,
            head_dim_kpe=sig.head_dim - sig.v_head_dim,
            page_size=meta.page_size,
            # extend: bottom-right aligned causal mask; decode: the one query sees its whole KV range.
            causal=step.mode is ForwardMode.EXTEND,
            sm_scale=sig.scale,
            q_data_type=self.pool.dtype,
            kv_data_type=self.pool.dtype,
            query_layout="packed",  # [tokens, heads, latent | rope] in one tensor
            kv_cache_layout="packed",  # [pages, page_size, latent | rope]: our pool entry as is
        )
        step.planned[sig] = wrapper
        return wrapper

    # ---------------------------------------------------------------- per layer

    def _run(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        step = self._step(meta)
        sig = LayerSignature.of(layer)
        wrapper = step.planned.get(sig)
        if wrapper is None:
            self._check_layer(layer, meta)
            wrapper = self._plan(meta, step, sig)
            self._known[sig] = None
        cache = self.pool.k(layer.layer_id)  # [num_pages, 1, page_size, latent + rope]
        out = torch.empty(q.shape[0], sig.num_heads, sig.v_head_dim, dtype=q.dtype, device=q.device)
        return wrapper.run(query=q, kv_cache=cache[:, 0], out=out)  # -> [tokens, heads, latent]

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        return self._run(layer, q, meta)

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        return self._run(layer, q, meta)
