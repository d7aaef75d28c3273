"""Piecewise CUDA graphs: the steps the decode graphs do not serve (prompt chunks, mixed steps) replayed as
graphs everywhere but in attention, which runs eagerly between the pieces.

An eager step of a few hundred tokens spends longer launching its kernels than the GPU spends running them:
every layer's norms, projections, RoPE and MLP are Python calls and launches. Attention is the part whose
shape follows the batch (requests, prefixes, pages, the backend's plan); everything else depends only on the
number of tokens. So per bucket of token counts the model's forward is captured as one graph per stretch
between two attention calls, as vLLM does: the ``Attention`` layer hands its inputs to ``ctx.split``, which
ends the piece being captured, and a replay runs the attention in that gap, eagerly, on the step's real rows,
with the step's own metadata and plan (the one store path, any backend).

The pieces meet attention in static slots shared by every layer and bucket: a piece ends by copying q, k and v
into them (a copy of the step's rows, small beside the projections), and the next piece starts from the output
slot. Rows past the step's tokens are padding: they compute on stale inputs and are never attended nor read.

``emulate=True`` runs the same cuts without graphs (each step a padded forward whose attention runs in the
gap at once): what the CPU tests check, and the same slots and views a replay reads.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from attnzoo.attention.layer import Attention, ForwardContext, beyond_the_layer
from attnzoo.attention.metadata import BatchMetadata, build_metadata
from attnzoo.errors import BackendError


def default_buckets(top: int) -> list[int]:
    """Token counts captured up to ``top``: 16, 24, 32, then a quarter of the octave apart to 512 and an eighth
    above. A step pads to the first that holds it, and its GEMMs compute the padding rows too: at most a
    quarter more from 32 tokens on, an eighth more past 512."""
    out, b = [16, 24], 32
    while b < top:
        out.append(b)
        b += 1 << (b.bit_length() - (3 if b < 512 else 4))
    return sorted({x for x in out if x < top} | {top})


@dataclass
class Cut:
    """One attention call cut out of a bucket's forward: its layer, and its inputs and output as views of the
    slots over the bucket's rows (k, v None where the layer passed none)."""

    layer: Attention
    q: torch.Tensor  # [bucket, heads, head_dim]
    k: torch.Tensor | None  # [bucket, kv_heads, head_dim]
    v: torch.Tensor | None  # [bucket, kv_heads, v_head_dim]
    out: torch.Tensor  # [bucket, heads * v_head_dim]


class PiecewiseGraphs:
    def __init__(self, model, pool, backends, *, max_tokens: int = 512, buckets=None, emulate: bool = False):
        self.model, self.pool, self.backends = model, pool, backends
        self.buckets = default_buckets(max_tokens) if buckets is None else sorted(
            {b for b in buckets if b < max_tokens} | {max_tokens})
        self.max_tokens = self.buckets[-1]
        self.emulate = emulate
        dev, n = pool.device, self.max_tokens
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_tokens]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_tokens]
        self.slots: dict[str, torch.Tensor] = {}  # "q", "k", "v", "out": flat [max_tokens * widest row]
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> its graphs, one per gap plus one
        self.cuts: dict[int, list[Cut]] = {}  # bucket -> its attention calls, in order
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> the last piece's output [bucket, hidden]
        self.mempool = None
        self.capture_s = 0.0  # host time of the captures at load (warm-ups included)
        self._alloc_slots()
        if not emulate:
            t0 = time.perf_counter()
            self._capture_all()
            self.capture_s = time.perf_counter() - t0

    @property
    def num_graphs(self) -> int:
        return sum(len(g) for g in self.pieces.values())

    def fits(self, meta: BatchMetadata) -> bool:
        return int(meta.positions.shape[0]) <= self.max_tokens

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _context(self, bs: int, split, plan=None) -> ForwardContext:
        """A forward's context over the static inputs of ``bs`` tokens (one request from position 0 in page 0):
        model code outside attention reads only its positions; the attention calls go to ``split``. Built
        before a capture: its metadata is copied to the device. The attention never runs on it, so ``plan``
        is never read (None: the backends prepare one for the dummy step, once per capture)."""
        cols = -(-bs // self.pool.page_size)
        # a window group's table must name a live page (never written here: attention is not run)
        window = [[1] * cols] if self.pool.has_window_group else None
        meta = build_metadata(prefix_lens=[0], q_lens=[bs], block_tables=[[0] * cols], page_size=self.pool.page_size,
                              device=self.pool.device, window_block_tables=window)
        meta = dataclasses.replace(meta, positions=self.positions[:bs])
        return ForwardContext(meta, self.pool, self.backends.prefill_backend, self.backends.decode_backend, plan,
                              split=split)

    def _forward(self, bs: int, ctx: ForwardContext) -> torch.Tensor:
        return self.model(self.ids[:bs], self.positions[:bs], ctx)

    @torch.inference_mode()
    def _alloc_slots(self) -> None:
        """Slots as wide as the widest layer's q, k, v and output rows, from a probe forward (no attention).
        The probe also checks that every attention layer of the model reaches the split: one that does not
        would be captured into a piece with the dummy step's metadata."""
        if why := beyond_the_layer(self.model, self.pool):
            raise BackendError(f"piecewise CUDA graphs cannot cut this model: {why}",
                               fix="leave piecewise_graph_tokens at 0 for this model")
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        widest: dict[str, int] = {}
        dtypes: set[torch.dtype] = set()
        seen: set[int] = set()

        def probe(layer, q, k, v):
            seen.add(id(layer))
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t is not None:
                    widest[name] = max(widest.get(name, 0), t[0].numel())
                    dtypes.add(t.dtype)
            widest["out"] = max(widest.get("out", 0), layer.num_heads * layer.v_head_dim)
            return q.new_zeros(q.shape[0], layer.num_heads * layer.v_head_dim)

        self._forward(1, self._context(1, probe))
        if not layers or seen != {id(m) for m in layers}:
            raise BackendError(f"piecewise CUDA graphs: {len(seen)} of the model's {len(layers)} attention layers "
                               "reached the split (attention computed outside the shared layer)",
                               fix="leave piecewise_graph_tokens at 0 for this model")
        if len(dtypes) > 1:
            raise BackendError(f"piecewise CUDA graphs need one activation dtype at attention, got "
                               f"{sorted(map(str, dtypes))}", fix="leave piecewise_graph_tokens at 0 for this model")
        dtype = dtypes.pop()
        for name, width in widest.items():
            self.slots[name] = torch.zeros(self.max_tokens * width, dtype=dtype, device=self.pool.device)

    def _slot(self, name: str, shape: torch.Size) -> torch.Tensor:
        return self.slots[name][: shape.numel()].view(shape)

    def _cut(self, layer: Attention, q, k, v, cuts: list[Cut]) -> torch.Tensor:
        """End a piece at an attention call: its inputs into the slots (inside the piece), and the output slot as
        the attention's result for the piece after."""
        slots = [None if t is None else self._slot(name, t.shape) for name, t in (("q", q), ("k", k), ("v", v))]
        for slot, t in zip(slots, (q, k, v)):
            if t is not None:
                slot.copy_(t)
        out = self._slot("out", torch.Size((q.shape[0], layer.num_heads * layer.v_head_dim)))
        cuts.append(Cut(layer, *slots, out))
        return out

    @staticmethod
    def _attend(cut: Cut, n: int, ctx: ForwardContext) -> None:
        """The gap after a piece: ``cut``'s attention over the step's ``n`` real rows, into the output slot."""
        k = None if cut.k is None else cut.k[:n]
        v = None if cut.v is None else cut.v[:n]
        cut.out[:n].copy_(cut.layer.attend(cut.q[:n], k, v, ctx))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: smaller buckets reuse its memory
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                # warm-up: kernels compile and the allocator settles, attention left out
                self._forward(bs, self._context(bs, lambda layer, q, k, v: self._cut(layer, q, k, v, [])))
                cuts: list[Cut] = []
                graphs = [torch.cuda.CUDAGraph()]

                def split(layer, q, k, v):
                    out = self._cut(layer, q, k, v, cuts)
                    graphs[-1].capture_end()
                    graphs.append(torch.cuda.CUDAGraph())
                    graphs[-1].capture_begin(pool=self.mempool)
                    return out

                ctx = self._context(bs, split)
                torch.cuda.synchronize()  # as torch.cuda.graph does: nothing of the warm-up pending at capture
                graphs[0].capture_begin(pool=self.mempool)
                self.hidden[bs] = self._forward(bs, ctx)
                graphs[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            self.pieces[bs], self.cuts[bs] = graphs, cuts
        torch.cuda.synchronize()

    def launch(self, ids: torch.Tensor, meta: BatchMetadata, plan) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a step that ``fits``: its ids and positions into the static
        inputs, then the pieces replayed with its attention (``meta``, ``plan``) in the gaps."""
        n = int(meta.positions.shape[0])
        bs = self._bucket(n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(meta.positions)
        ctx = ForwardContext(meta, self.pool, self.backends.prefill_backend, self.backends.decode_backend, plan)
        if self.emulate:
            def split(layer, q, k, v):
                cut = []
                out = self._cut(layer, q, k, v, cut)
                self._attend(cut[0], n, ctx)
                return out

            return self._forward(bs, self._context(bs, split, plan))[:n]
        graphs, cuts = self.pieces[bs], self.cuts[bs]
        for graph, cut in zip(graphs, cuts):
            graph.replay()
            self._attend(cut, n, ctx)
        graphs[-1].replay()
        return self.hidden[bs][:n]
