"""Sequence-parallel attention: Ulysses (all-to-all heads <-> sequence), ring (K/V passed around, partial results
merged by log-sum-exp) and USP (Ulysses inside, ring across), all with uneven shard lengths and key-padding masks.

Why our own and not diffusers' templated ulysses/ring attention: diffusers' needs every shard to have the same
length (it all-to-alls equal chunks) and supports no attention mask in its ring; ours takes shards of any length
(all_to_all with per-peer shapes, ring with padding + key mask) and the key-padding masks of Qwen-Image/Z-Image.

Layout is diffusers' dispatcher layout, (batch, seq, heads, head_dim), throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import AccelError
from .mesh import ParallelMesh, all_to_all_uneven, gather_uneven


@dataclass
class SequenceContext:
    """Per-process state of the sequence-parallel pass; ``region`` is set while a sharded block list runs."""

    mesh: ParallelMesh
    region: Any = None  # the RegionState of the block list that runs on shards right now
    local_depth: int = 0  # > 0 inside an attention whose keys are not split (cross-attention to unsplit text)
    inside: bool = False  # inside our own attention (the inner call must not be split again)
    calls: int = 0  # sequence-parallel attention calls so far (tests assert the pass really ran)
    slot: int = 0  # index of the current attention call within the current block
    _lengths: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.region is not None and self.local_depth == 0 and not self.inside

    def reset(self) -> None:
        self.region = None
        self.local_depth = 0
        self.inside = False
        self.slot = 0
        self._lengths.clear()

    def lengths(self, name: str, local: tuple[int, ...], device) -> list[tuple[int, ...]]:
        """Local lengths (a tuple: query and key length) of every rank of group ``name``.

        All-gathered once per attention slot of a region per forward: the cache key (group, region, slot) is the
        same on every rank -- a key built from the local length would not be, since shards differ in length, and a
        rank that found its key cached would skip a collective the others enter.
        """
        ranks = self.mesh.group_ranks(name)
        if len(ranks) == 1:
            return [local]
        key = (name, getattr(self.region, "name", None), self.slot)
        if key not in self._lengths:
            t = torch.tensor(list(local), dtype=torch.int64, device=device)
            bufs = [torch.empty_like(t) for _ in ranks]
            dist.all_gather(bufs, t, group=self.mesh.group(name))
            self._lengths[key] = [tuple(int(x) for x in b.tolist()) for b in bufs]
        return self._lengths[key]


def _key_bias(attn_mask: torch.Tensor | None, batch: int, sk: int) -> tuple[torch.Tensor | None, bool]:
    """A key-padding mask as an additive (B, Sk) float bias; (None, False) without a mask. Refuses full masks."""
    if attn_mask is None:
        return None, False
    m = attn_mask
    if m.ndim == 4:
        if m.shape[1] != 1 or m.shape[2] != 1:
            raise AccelError(
                f"sequence parallelism supports key-padding attention masks of shape (B, 1, 1, S_k) only; got "
                f"{tuple(m.shape)}. Run this model without sp, or report the model so its mask can be handled."
            )
        m = m[:, 0, 0, :]
    elif m.ndim == 3:
        if m.shape[1] != 1:
            raise AccelError(f"sequence parallelism: unsupported attention mask shape {tuple(m.shape)}.")
        m = m[:, 0, :]
    if m.shape[-1] != sk:
        raise AccelError(f"sequence parallelism: attention mask covers {m.shape[-1]} keys, the keys are {sk}.")
    m = m.expand(batch, sk)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf")), True
    return m.float(), False


def _bias_to_mask(bias: torch.Tensor | None, was_bool: bool, dtype) -> torch.Tensor | None:
    if bias is None:
        return None
    if was_bool:
        return torch.isfinite(bias)[:, None, None, :]
    return bias.to(dtype)[:, None, None, :]


def _ulysses_in(x: torch.Tensor, group, sizes: list[int], me: int) -> torch.Tensor:
    """(B, S_me, H, D) -> (B, sum(sizes), H/U, D): scatter heads, gather the sequence."""
    u = len(sizes)
    chunks = list(x.chunk(u, dim=2))
    b, _, h, d = chunks[0].shape
    outs = all_to_all_uneven(chunks, [(b, s, h, d) for s in sizes], group)
    return torch.cat(outs, dim=1)


def _ulysses_out(x: torch.Tensor, group, sizes: list[int], me: int) -> torch.Tensor:
    """(B, sum(sizes), H/U, D) -> (B, S_me, H, D): scatter the sequence, gather heads."""
    pieces = list(x.split(sizes, dim=1))
    b, _, h, d = x.shape
    outs = all_to_all_uneven(pieces, [(b, sizes[me], h, d)] * len(sizes), group)
    return torch.cat(outs, dim=2)


def _partial(q, k, v, bias, scale):
    """Attention of q against one K/V chunk in fp32: (out (B,Sq,H,D), lse (B,H,Sq))."""
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias[:, None, None, :]
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])
    out = torch.matmul(p, vf).transpose(1, 2)
    return out, lse


def ring_attention(q, k, v, bias, scale, ctx: SequenceContext) -> torch.Tensor:
    """Ring attention over the ring group: K/V (and the key bias) travel around the ring by send/recv; the partial
    outputs are merged with log-sum-exp, exact up to float rounding. Shards of unequal length are padded and the
    padding keys masked."""
    mesh = ctx.mesh
    group = mesh.group("ring")
    ranks = mesh.group_ranks("ring")
    n = len(ranks)
    me = ranks.index(mesh.rank)
    sizes = [s[1] for s in ctx.lengths("ring", (q.shape[1], k.shape[1]), k.device)]
    longest = max(sizes)
    b = q.shape[0]
    if bias is None and any(s != longest for s in sizes):
        bias = torch.zeros((b, k.shape[1]), dtype=torch.float32, device=k.device)
    if k.shape[1] < longest:
        pad = longest - k.shape[1]
        k = torch.cat([k, k.new_zeros((b, pad) + tuple(k.shape[2:]))], dim=1)
        v = torch.cat([v, v.new_zeros((b, pad) + tuple(v.shape[2:]))], dim=1)
        bias = torch.cat([bias, bias.new_full((b, pad), float("-inf"))], dim=1)
    cur = [k.contiguous(), v.contiguous()] + ([bias.contiguous()] if bias is not None else [])
    out_acc, lse_acc = None, None
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n):
        reqs, incoming = [], None
        if step < n - 1:
            incoming = [torch.empty_like(t) for t in cur]
            ops = [dist.P2POp(dist.isend, t, nxt, group) for t in cur]
            ops += [dist.P2POp(dist.irecv, t, prv, group) for t in incoming]
            reqs = dist.batch_isend_irecv(ops)
        out_s, lse_s = _partial(q, cur[0], cur[1], cur[2] if len(cur) > 2 else None, scale)
        if out_acc is None:
            out_acc, lse_acc = out_s, lse_s
        else:
            new_lse = torch.logaddexp(lse_acc, lse_s)
            safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
            w_old = torch.exp(lse_acc - safe).transpose(1, 2)[..., None]
            w_new = torch.exp(lse_s - safe).transpose(1, 2)[..., None]
            out_acc = out_acc * w_old + out_s * w_new
            lse_acc = new_lse
        for r in reqs:
            r.wait()
        if incoming is not None:
            cur = incoming
    return out_acc.to(q.dtype)


def sequence_parallel_attention(q, k, v, attn_mask, inner: Callable, scale: float | None, ctx: SequenceContext):
    """Attention over the whole sequence of the sequence group, from this rank's shard of q/k/v (B, S, H, D).

    Ulysses first (within the ulysses group: every rank gets all tokens of the group for H/U heads), then ring
    across the ring group; ``inner(q, k, v, mask)`` is the original attention (used when there is no ring).
    """
    mesh = ctx.mesh
    heads = q.shape[2]
    if heads % mesh.ulysses:
        raise AccelError(
            f"ulysses={mesh.ulysses} does not divide the {heads} attention heads this rank holds; choose ulysses "
            f"among the divisors of {heads} (use ring for the rest of the sequence degree)."
        )
    bias, was_bool = _key_bias(attn_mask, q.shape[0], k.shape[1])
    if mesh.ulysses > 1:
        group = mesh.group("ulysses")
        me = mesh.group_ranks("ulysses").index(mesh.rank)
        both = ctx.lengths("ulysses", (q.shape[1], k.shape[1]), q.device)
        q_sizes, k_sizes = [s[0] for s in both], [s[1] for s in both]
        if q.shape == k.shape == v.shape:
            qkv = torch.stack([q, k, v], dim=0)  # one all-to-all for the three
            # heads stay grouped per destination: chunk(U) on dim 2 then splits heads, not q/k/v
            flat = qkv.permute(1, 2, 3, 0, 4)  # B, S, H, 3, D
            b_, s_, h_, _, d_ = flat.shape
            flat = flat.reshape(b_, s_, h_, 3 * d_)
            g = _ulysses_in(flat, group, q_sizes, me).reshape(b_, sum(q_sizes), h_ // mesh.ulysses, 3, d_)
            q, k, v = g.unbind(dim=3)
        else:
            q = _ulysses_in(q, group, q_sizes, me)
            k = _ulysses_in(k, group, k_sizes, me)
            v = _ulysses_in(v, group, k_sizes, me)
        if bias is not None:
            bias = gather_uneven(bias, 1, k_sizes, group)
    else:
        q_sizes, me, group = None, 0, None
    if mesh.ring > 1:
        out = ring_attention(q, k, v, bias, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), ctx)
    else:
        out = inner(q, k, v, _bias_to_mask(bias, was_bool, q.dtype))
    if mesh.ulysses > 1:
        out = _ulysses_out(out.contiguous(), group, q_sizes, me)
    return out
