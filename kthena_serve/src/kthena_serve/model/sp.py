"""Sequence parallelism over the tensor-parallel group (Megatron style), applied from outside.

With SP on, a long forward's tokens are cut into ``tp`` contiguous shards, one per rank, for the
layers' token-wise work (embedding, RMSNorm, residual adds); the matmuls keep TP's split of heads
and MLP columns over all of the step's tokens, so each rank still writes the K/V of its own heads
(`kthena_core.shape`'s rule) for every token into its own pool, and decode is plain TP::

    s = ceil(T / tp): rank r holds tokens [r*s, (r+1)*s); the last shard ends in pad rows

    x_r [s, H] ─ norm ─ all_gather ─▶ x [tp*s, H] ─ qkv (my heads) ─▶ first T rows ─ attention
      ─ o_proj (my heads' partial sums, T rows + pad) ─ reduce_scatter ─▶ [s, H] ─ + residual_r
      ─ norm ─ all_gather ─ gate_up, down (partial sums) ─ reduce_scatter ─▶ [s, H] ─ ...
    last layer: the rows the LM head needs ── all_reduce of [2, rows, H] (zeros elsewhere) ──▶

TP's all-reduce after each row-parallel matmul becomes a reduce-scatter, and an all-gather comes
before each column-parallel one; the residual stream, norms and embedding hold 1/tp of the tokens.
Pad rows never reach attention, and every other op is row-wise, so they change no real token.
A forward with fewer than `SequenceParallel.min_tokens` tokens, or a decode-only one, runs as
plain TP. The model still makes no collective call of its own: it calls the `TensorParallel`'s,
each collective with the matmul beside it as one op (`gather_linear`, `linear_scatter_sum`), so
TP overlap (`kthena_serve.model.overlap`) can fuse the pair.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from kthena_serve.model.errors import TensorParallelError
from kthena_serve.model.tp import Matmul, TensorParallel

__all__ = ["SequenceParallel", "TokenShards"]


def _min_tokens(_inst: object, _attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TensorParallelError(f"SequenceParallel.min_tokens must be a positive int (a "
                                  f"forward with fewer tokens runs as plain TP), got {value!r}")


@attrs.frozen
class SequenceParallel:
    """Sequence parallelism over the TP group for forwards of at least ``min_tokens`` tokens.

    Attributes:
        min_tokens: a forward with fewer tokens (and every decode-only one) runs as plain TP.
    """

    min_tokens: int = attrs.field(default=1, validator=_min_tokens)

    def shards(self, tp: TensorParallel, num_tokens: int, is_decode_only: bool) -> TokenShards | None:
        """This forward's token shards, or None when it runs as plain TP."""
        if tp.world_size == 1 or is_decode_only or num_tokens < self.min_tokens:
            return None
        return TokenShards(tp, num_tokens)


@attrs.frozen
class TokenShards:
    """One forward's split of ``num_tokens`` tokens over the TP group (see the module docs).

    Attributes:
        tp: the group (its rank says which shard is this rank's).
        num_tokens: T, the forward's real tokens.
    """

    tp: TensorParallel
    num_tokens: int

    @property
    def size(self) -> int:
        """s: tokens per shard (the last one padded up to it)."""
        return -(-self.num_tokens // self.tp.world_size)

    @property
    def padded(self) -> int:
        """tp x s: rows of a gathered tensor (T plus the pad rows)."""
        return self.size * self.tp.world_size

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [tp*s, ...] with zero rows after the real ones (``x`` itself if none)."""
        extra = self.padded - x.shape[0]
        return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a [T, ...] tensor (pad rows included)."""
        start = self.tp.rank * self.size
        return self.pad(x)[start:start + self.size]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's [s, ...] shard -> the whole [tp*s, ...] tensor, in token order."""
        return self.tp.all_gather(x.contiguous())

    def scatter_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The group's [tp*s, ...] partial sums -> this rank's [s, ...] shard of their sum."""
        return self.tp.reduce_scatter(partial.contiguous())

    def gather_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      matmul: Matmul) -> torch.Tensor:
        """``matmul(gather(x), weight, bias)`` as one op (an MC2 all-gather + matmul when the
        TP group has fused collectives)."""
        return self.tp.all_gather_linear(x.contiguous(), weight, bias, matmul)

    def linear_scatter_sum(self, x: torch.Tensor, weight: torch.Tensor,
                           matmul: Matmul) -> torch.Tensor:
        """``scatter_sum(matmul(x, weight))`` as one op (an MC2 matmul + reduce-scatter when
        the TP group has fused collectives); ``x`` has tp*s rows."""
        return self.tp.linear_reduce_scatter(x, weight, matmul)

    def rows(self, x: torch.Tensor, residual: torch.Tensor,
             index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``index`` (positions among the T tokens) of the sharded (x, residual) pair, on
        every rank: each rank fills the rows it holds, zeros elsewhere, and one all-reduce of
        the pair sums them (adding zeros is exact)."""
        start = self.tp.rank * self.size
        local = index - start
        mine = ((local >= 0) & (local < self.size)).unsqueeze(-1)
        at = local.clamp(0, self.size - 1)
        both = torch.stack([torch.where(mine, x[at], 0), torch.where(mine, residual[at], 0)])
        both = self.tp.all_reduce(both)
        return both[0], both[1]
