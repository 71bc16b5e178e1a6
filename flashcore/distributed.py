"""Context parallelism: ring attention over torch.distributed, for sequences longer than one device can hold.

Each rank of a process group holds its slice of the sequence (queries, keys and values alike). The key/value
blocks travel around the ring while every rank attends its queries to the block it holds, and the partial results
are merged through their log-sum-exp, exactly (the same softmax as over the whole sequence):
    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
The backward sends dK/dV accumulators around the ring with their blocks; every block's gradients are computed by
flashcore's backward op from the global out and lse (which make P = exp(scale q.k - lse) the whole sequence's
probabilities), so the ring needs no second pass of softmax statistics. The next block's send/receive
(torch.distributed P2P, batch_isend_irecv) is issued before the current block is computed, so communication runs
under the computation (NCCL's own streams on GPUs; gloo's threads on CPUs).

Causal attention is balanced by the zigzag layout: the sequence is cut into 2W chunks and rank r holds chunks r and
2W - 1 - r (`zigzag_shard` / `zigzag_unshard` make and undo it), so every rank does the same work: its own slice
causally, an earlier rank's first chunk with all its queries, a later rank's slice with its second chunk
(`_causal_plan`).

Usage (every rank, inside an initialized process group):
    q, k, v = (zigzag_shard(t, dim=2) for t in (q_full, k_full, v_full))   # causal; contiguous chunks otherwise
    out = ring_attention(q, k, v, causal=True)                             # this rank's slice of the output
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard"]

_fwd = torch.ops.flashcore.fwd.default
_bwd = torch.ops.flashcore.bwd.default


def zigzag_shard(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's zigzag slice of a full-sequence tensor: chunks r and 2W - 1 - r of 2W along `dim`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The full-sequence tensor from every rank's zigzag slice (an all-gather; for tests and checks)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        chunks[r], chunks[2 * world - 1 - r] = a, b
    return torch.cat(chunks, dim=dim)


class _Ring:
    """The send/receive of one ring step: tensors to the next rank, buffers from the previous one."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else (
            (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else (
            (self.rank - 1) % self.world)
        self.works = None

    def start(self, tensors):
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        self.works = dist.batch_isend_irecv(ops)
        return bufs

    def wait(self):
        for w in self.works or ():
            w.wait()
        self.works = None


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulators of the ring: float32, float64 for float64 inputs (whose op returns a float64 lse too)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _merge_(out, lse, part_out, part_lse):
    """Merges one block's normalized (out, lse) into the running (out, lse) in place (views of the rows it covers)."""
    new = torch.logaddexp(lse, part_lse)
    # rows no block has seen yet keep -inf: exp(-inf - -inf) would be NaN
    w_old = torch.exp(lse - new).nan_to_num_(0.0).unsqueeze(-1)
    w_new = torch.exp(part_lse - new).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(w_old).addcmul_(part_out, w_new)
    lse.copy_(new)


def _causal_plan(step_src: int, rank: int, world: int):
    """For zigzag causal: which (query chunk, key chunk, mask) pairs rank `rank` computes against the block of rank
    `step_src`. Chunks: 0 = the first half of a rank's slice (chunk r of 2W), 1 = the second (chunk 2W - 1 - r).
    Returns [(q_part, k_part, causal)] with parts 0, 1 or None (the whole slice)."""
    if step_src == rank:
        return [(None, None, True)]  # the slice against itself: its chunks are in sequence order
    if step_src < rank:
        return [(None, 0, False)]  # every query sees the earlier rank's first chunk whole, its second not at all
    return [(1, None, False)]  # the second chunk sees the later rank's slice whole; the first sees nothing


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, deterministic):
        ring = _Ring(group)
        world, rank = ring.world, ring.rank
        S = q.size(2)
        half = S // 2
        parts = {None: slice(0, S), 0: slice(0, half), 1: slice(half, S)}
        acc = _acc_dtype(q)
        out = lse = None
        kv = (k, v)
        for step in range(world):
            src = (rank - step) % world
            if step + 1 < world:
                incoming = ring.start(kv)  # the next block travels while this one is computed
            plan = _causal_plan(src, rank, world) if causal else [(None, None, False)]
            for qp, kp, c in plan:
                qs, ks = parts[qp], parts[kp]
                o, l = _fwd(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, c, False, -1, -1, 0.0,
                            deterministic)
                if out is None:  # step 0 (the rank's own block) covers every row: nothing to merge with yet
                    out, lse = o.to(acc), l.to(acc)
                else:
                    _merge_(out[:, :, qs], lse[:, :, qs], o, l)
            if step + 1 < world:
                ring.wait()
                kv = tuple(incoming)
        out = out.to(q.dtype)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.deterministic = group, causal, scale, deterministic
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        world, rank = ring.world, ring.rank
        S = q.size(2)
        half = S // 2
        parts = {None: slice(0, S), 0: slice(0, half), 1: slice(half, S)}
        dout = dout.contiguous()
        acc = _acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = (k, v)
        # The dK/dV accumulators travel with their block, one step behind it: those of the block at hand arrive
        # (sent by the rank that computed it last) while this rank computes the block's contributions, and leave
        # for the next rank while it computes the next block, so their transfer hides under the computation too.
        arriving = None  # step 0 is the rank's own block, whose accumulators start at zero
        for step in range(world):
            src = (rank - step) % world
            if step + 1 < world:
                incoming = ring.start(kv)
            plan = _causal_plan(src, rank, world) if ctx.causal else [(None, None, False)]
            contributions = []
            for qp, kp, c in plan:
                qs, ks = parts[qp], parts[kp]
                # The global out and lse make this block's P and dS exact (softmax over the whole sequence).
                gq, gk, gv = _bwd(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
                                  lse[:, :, qs].contiguous(), ctx.scale, c, False, -1, -1, 0.0, ctx.deterministic)
                dq[:, :, qs].add_(gq)
                contributions.append((ks, gk, gv))
            if arriving is None:
                dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                dk_acc, dv_acc = arriving()
            for ks, gk, gv in contributions:
                dk_acc[:, :, ks].add_(gk)
                dv_acc[:, :, ks].add_(gv)
            # to the rank that computes this block next; after the last step that is the block's home
            if world > 1:
                arriving = ring_send_recv(ring, (dk_acc, dv_acc))
            else:
                arriving = lambda done=(dk_acc, dv_acc): done  # noqa: E731 - a group of one is home already
            if step + 1 < world:
                ring.wait()
                kv = tuple(incoming)
        dk_acc, dv_acc = arriving()
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None, None, None, None


def ring_send_recv(ring: _Ring, tensors):
    """Sends `tensors` to the next rank and returns a function that waits for the previous rank's."""
    sub = _Ring(ring.group)
    bufs = sub.start(tensors)

    def done():
        sub.wait()
        return bufs

    return done


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                   scale: Optional[float] = None, enable_gqa: bool = False, layout: str = "bhsd",
                   deterministic: bool = False, return_lse: bool = False):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world).

    q: this rank's queries (B, Hq, S_local, D) (layout "bhsd") or (B, S_local, Hq, D) ("bshd"); k, v the same with
    Hkv heads (GQA/MQA with enable_gqa=True; K/V are never repeated). Non-causal: rank r holds contiguous slice r of
    the sequence. Causal: the zigzag layout (zigzag_shard), S_local even. Differentiable (q, k, v). Returns this
    rank's slice of the output, like q (and the float32 (B, Hq, S_local) log-sum-exp with return_lse=True).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcore.distributed.ring_attention: torch.distributed is not initialized")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"flashcore.distributed.ring_attention: layout must be 'bhsd' or 'bshd'; got {layout!r}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RuntimeError("flashcore.distributed.ring_attention: q, k and v must be 4-D")
    if not enable_gqa and q.size(1) != k.size(1):
        raise RuntimeError(f"flashcore.distributed.ring_attention: q has {q.size(1)} heads but k has {k.size(1)}; "
                           "pass enable_gqa=True for grouped-query attention")
    if q.size(2) != k.size(2):
        raise RuntimeError("flashcore.distributed.ring_attention: every rank holds the same slice of queries and "
                           f"keys; got {q.size(2)} queries and {k.size(2)} keys")
    if causal and q.size(2) % 2:
        raise RuntimeError("flashcore.distributed.ring_attention: causal needs the zigzag layout (zigzag_shard), "
                           f"two chunks of equal length a rank; got {q.size(2)} tokens")
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), float(scale), bool(deterministic))
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
