"""RoPE in the key store's launch: ``KVPool.store(..., rope=RoPE(q, cos, sin))`` rotates q and the keys in place
as it stores them (``kernels/store.py``). ``RoPE.problem`` names the rows it cannot take, so the layer rotates first
(``fused.rope``) and the pool refuses them; ``overlaps`` tells whether two views may share a byte."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _footprint(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(first byte, row pitch in bytes or 0, bytes of a row, bytes from the first element to past the last)."""
    shape, stride, e = x.shape, x.stride(), x.element_size()
    if 0 in shape:
        return 0, 0, 0, 0
    row = sum((n - 1) * st for n, st in zip(shape[1:], stride[1:])) * e + e
    pitch = stride[0] * e if len(shape) > 1 and shape[0] > 1 else 0
    return x.data_ptr(), pitch, row, row + (shape[0] - 1) * stride[0] * e if shape else e


def _meet(fa: tuple[int, int, int, int], fb: tuple[int, int, int, int]) -> bool:
    (a0, pa, ra, wa), (b0, pb, rb, wb) = fa, fb
    if not (wa and wb and a0 < b0 + wb and b0 < a0 + wa):
        return False
    if pa and pa == pb and pa > 0 and max(ra, rb) <= pa:  # rows one pitch apart: windows modulo the pitch
        gap = (b0 - a0) % pa
        return not (gap >= ra and gap + rb <= pa)
    return True


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views may share a byte: their address spans meet and, for rows a row pitch apart in both (q, k
    and v of a fused QKV projection), their windows modulo the pitch do too. Addresses, not storages: two storages
    may hold the same memory."""
    return _meet(_footprint(a), _footprint(b))


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class RoPE:
    """RoPE that ``KVPool.store`` applies as it stores a step's keys: ``q`` [T, H, D] and the keys rotated in
    place by ``cos``/``sin`` [T, R] float32 (``fused.rope``'s convention: cat(f, f), R <= D). Made per layer call:
    ``problem`` answers again for the same k and v objects without looking, so it does not see their layout
    changed in place (``set_``, ``transpose_``) between two asks."""

    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False
    # (k, v, verdict) of the last ``problem``: the layer asks before it stores, the pool again as it stores
    _last: tuple | None = field(default=None, init=False, repr=False)

    def problem(self, k: torch.Tensor | None, v: torch.Tensor | None) -> str | None:
        """Why the store cannot rotate these rows in place (None: it can): what its kernel takes, on any device."""
        last = self._last
        if last is not None and last[0] is k and last[1] is v:
            return last[2]
        verdict = self._problem(k, v)
        object.__setattr__(self, "_last", (k, v, verdict))  # a memo: the fields stay as built
        return verdict

    def _problem(self, k: torch.Tensor | None, v: torch.Tensor | None) -> str | None:
        if k is None:
            return "no keys to rotate"
        if problem := self.rows_problem(k):
            return problem
        fq, fk = _footprint(self.q), _footprint(k)
        fv = None if v is None else _footprint(v)
        if _meet(fq, fk) or (fv is not None and (_meet(fk, fv) or _meet(fq, fv))):
            return "q, k and v share memory: rotating one in place would change another"
        return None

    def rows_problem(self, k: torch.Tensor) -> str | None:
        """What the store's kernel cannot take in q, k, cos and sin themselves (None: nothing)."""
        q, cos = self.q, self.cos
        if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            return f"q {tuple(q.shape)} and k {tuple(k.shape)} are not [tokens, heads, head_dim] of one head_dim"
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            return "q or k has channels of a stride other than 1"
        if (cos.dtype != torch.float32 or self.sin.dtype != torch.float32 or cos.shape != self.sin.shape
                or cos.dim() != 2 or cos.shape[0] != k.shape[0] or cos.shape[1] % 2 or cos.shape[1] > k.shape[2]):
            return f"cos/sin {tuple(cos.shape)} {cos.dtype} are not float32 [tokens, R], R even, at most head_dim"
        return None
