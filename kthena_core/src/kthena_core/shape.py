"""ModelShape: a decoder's tensor geometry, and the one rule for splitting its heads over TP ranks
(and its layers over pipeline stages: `stage_layer_range`, equal or cut at split points).

The rule lives here and nowhere else: the planner, the config check, the engine's shard plan
and every KV pool's sizing call these functions.

    tp <= kv_heads   the KV heads are cut into tp contiguous runs as even as whole heads allow,
                     larger runs first; a rank's query heads are those that read its KV heads.
    tp >  kv_heads   tp must be a multiple of kv_heads: each KV head is replicated on
                     tp / kv_heads ranks, which split that head's query heads between them.

    heads=9, kv_heads=3, tp=2            heads=8, kv_heads=2, tp=4
    rank   0        1                    rank   0     1     2     3
    kv     0 1      2                    kv     0     0     1     1
    q      0..5     6..8                 q      0-1   2-3   4-5   6-7

Ranks share block ids, so every rank's KV pool has the same number of blocks and is sized for
the largest share: ``kv_heads_per_rank(kv_heads, tp)`` with no rank.

The engine runs any tp `check_tp` accepts, uneven splits included (SmolLM2's 9 heads over tp=2:
6 + 3). The planner proposes only tp that divide the heads, every rank holding as many
(`tp_sizes_dividing_heads`, `check_tp_divides_heads`): with an uneven split the rank holding
the most heads sets every step's pace (128 heads over tp=25: 6 on some ranks, 5.12 on average).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kthena_core.dtypes import canonical_dtype


class ModelShapeError(ValueError):
    """A model shape with a non-positive size, or query heads that do not group over KV heads."""


class HeadSplitError(ValueError):
    """A tensor-parallel degree the heads cannot be split over."""


def _positive(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelShapeError(f"{attribute.name} must be a positive int, got {value!r}")


def _canonical(value: str) -> str:
    try:
        return canonical_dtype(value)
    except ValueError as e:
        raise ModelShapeError(str(e)) from None


@attrs.frozen
class ModelShape:
    """The sizes that fix a decoder's tensors: layers, heads, widths, vocabulary and dtype.

    The one geometry value of the SDK: `ModelSpec.shape` and the engine's `ModelConfig.shape`
    build it from a checkpoint's config, and the benchmark's roofline reads it.

    Attributes:
        num_layers: decoder layers.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (fewer than query heads under grouped-query attention).
        head_dim: elements per head.
        hidden_size: width of the residual stream.
        intermediate_size: width of the (dense) MLP.
        vocab_size: rows of the embedding.
        dtype: the checkpoint's weight dtype, as a short key ("bf16", "fp16", "fp32", ...).
    """

    num_layers: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="bf16", converter=_canonical)

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelShapeError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}")

    def check_tp(self, tp: int) -> None:
        """Raise unless `tp` ranks can split these heads (see `check_tp`)."""
        check_tp(self.num_attention_heads, self.num_kv_heads, tp)


def _split(total: int, parts: int, index: int) -> range:
    """Part `index` of `parts` contiguous, near-equal pieces of range(total), larger ones first."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def _check_kv(num_kv_heads: int, tp: int, rank: int | None) -> None:
    if num_kv_heads < 1 or tp < 1:
        raise HeadSplitError(f"num_kv_heads={num_kv_heads} and tp={tp} must both be >= 1")
    if rank is not None and not 0 <= rank < tp:
        raise HeadSplitError(f"rank={rank} is outside 0..{tp - 1} for tp={tp}")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise HeadSplitError(
            f"tp={tp} > num_kv_heads={num_kv_heads} must be a multiple of it (each KV head is "
            f"replicated on tp / num_kv_heads ranks); use tp <= {num_kv_heads} or a multiple "
            f"of {num_kv_heads}")


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank `rank` of `tp` holds, as a range of head indices.

    Args:
        num_kv_heads: the model's key/value heads.
        tp: tensor-parallel degree.
        rank: 0 .. tp - 1.
    Returns:
        A contiguous run (3 heads over 2 ranks: range(0, 2) and range(2, 3)); one replicated head
        when tp is a multiple of num_kv_heads (tp=4 over 2 heads: 0, 0, 1, 1).
    Raises:
        HeadSplitError: a count is not positive, rank is out of range, or tp exceeds
            num_kv_heads without being a multiple of it.
    """
    _check_kv(num_kv_heads, tp, rank)
    if tp <= num_kv_heads:
        return _split(num_kv_heads, tp, rank)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def kv_heads_per_rank(num_kv_heads: int, tp: int, rank: int | None = None) -> int:
    """How many KV heads a tensor-parallel rank holds.

    Args:
        num_kv_heads: the model's key/value heads.
        tp: tensor-parallel degree.
        rank: one rank, or None for the largest share: what every rank's KV pool must be sized
            for, since all ranks use the same block ids.
    Returns:
        len(kv_head_range(...)) for a rank; ceil(num_kv_heads / tp) for None (1 when replicated).
    Raises:
        HeadSplitError: as `kv_head_range`.
    """
    _check_kv(num_kv_heads, tp, rank)
    if rank is None:
        return -(-num_kv_heads // tp)
    return len(kv_head_range(num_kv_heads, tp, rank))


@attrs.frozen
class HeadMove:
    """One run of KV heads copied between two TP layouts of the same model: ``count`` heads
    starting at local head ``src_start`` of source rank ``src_rank`` go to local head
    ``dst_start`` of destination rank ``dst_rank`` (local: the index in that rank's own pool)."""

    src_rank: int
    src_start: int
    dst_rank: int
    dst_start: int
    count: int


def kv_head_moves(num_kv_heads: int, src_tp: int, dst_tp: int) -> tuple[HeadMove, ...]:
    """How KV written by ``src_tp`` ranks reaches the pools of ``dst_tp`` ranks: every head
    each destination rank holds (`kv_head_range`) comes from one source rank that holds it, in
    runs of consecutive heads. A head replicated on several source ranks is read from the
    first of them; one replicated on several destination ranks is written to each.

    Same tp: rank r to rank r, whole pools (one move per rank). Different tp: a source rank's
    heads are split over, or merged from, the destination ranks that own them (PD re-sharding
    between a prefill and a decode instance of different TP sizes).

    Raises:
        HeadSplitError: ``num_kv_heads`` cannot be split over ``src_tp`` or ``dst_tp``.
    """
    _check_kv(num_kv_heads, src_tp, None)
    _check_kv(num_kv_heads, dst_tp, None)
    holder = {}  # global head -> (source rank, local index); the first holder wins
    for rank in range(src_tp):
        for local, head in enumerate(kv_head_range(num_kv_heads, src_tp, rank)):
            holder.setdefault(head, (rank, local))
    moves: list[HeadMove] = []
    for dst in range(dst_tp):
        for local, head in enumerate(kv_head_range(num_kv_heads, dst_tp, dst)):
            src, src_local = holder[head]
            last = moves[-1] if moves else None
            if (last is not None and last.dst_rank == dst and last.src_rank == src
                    and last.src_start + last.count == src_local
                    and last.dst_start + last.count == local):
                moves[-1] = attrs.evolve(last, count=last.count + 1)
            else:
                moves.append(HeadMove(src, src_local, dst, local, 1))
    return tuple(moves)


def attention_head_range(num_attention_heads: int, num_kv_heads: int, tp: int, rank: int) -> range:
    """The query heads rank `rank` of `tp` holds: those reading its KV heads, split further
    between the ranks that replicate one KV head.

    Raises:
        HeadSplitError: as `check_tp`, or rank is out of range.
    """
    check_tp(num_attention_heads, num_kv_heads, tp)
    kv = kv_head_range(num_kv_heads, tp, rank)
    group = num_attention_heads // num_kv_heads
    if tp <= num_kv_heads:
        return range(kv.start * group, kv.stop * group)
    replicas = tp // num_kv_heads
    part = _split(group, replicas, rank % replicas)
    return range(kv.start * group + part.start, kv.start * group + part.stop)


def allowed_tp_sizes(num_attention_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """Every tp `check_tp` accepts: 1 .. num_kv_heads, then multiples of it up to the query heads."""
    up_to_kv = range(1, min(num_kv_heads, num_attention_heads) + 1)
    replicated = range(2 * num_kv_heads, num_attention_heads + 1, num_kv_heads)
    return (*up_to_kv, *replicated)


def check_tp(num_attention_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise unless `tp` ranks can split these heads with at least one query head each.

    Uneven splits are allowed (9 heads / 3 KV heads over tp=2: 6 + 3 query heads, 2 + 1 KV).

    Raises:
        HeadSplitError: a count is not positive, tp > num_attention_heads, or tp > num_kv_heads
            without being a multiple of it; the message lists the allowed values.
    """
    if num_attention_heads < 1 or num_kv_heads < 1 or tp < 1:
        raise HeadSplitError(f"num_attention_heads={num_attention_heads}, num_kv_heads={num_kv_heads} "
                             f"and tp={tp} must all be >= 1")
    allowed = ", ".join(map(str, allowed_tp_sizes(num_attention_heads, num_kv_heads)))
    if tp > num_attention_heads:
        raise HeadSplitError(
            f"tp={tp} exceeds num_attention_heads={num_attention_heads}, leaving a rank without "
            f"a query head; allowed tp: {allowed}")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise HeadSplitError(
            f"tp={tp} > num_kv_heads={num_kv_heads} must be a multiple of it (each KV head is "
            f"replicated on tp / num_kv_heads ranks); allowed tp: {allowed}")


def _divides_heads(num_attention_heads: int, num_kv_heads: int, tp: int) -> bool:
    """Whether every rank holds as many heads: tp divides the KV heads (each rank a run of
    them), or is a multiple of them dividing the query heads (each KV head's replicas split its
    query heads). Both imply tp divides the query heads."""
    return num_attention_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)


def tp_sizes_dividing_heads(num_attention_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """The tp the planner proposes: those `check_tp` accepts that split the heads evenly, every
    rank holding as many query heads and KV heads (128 heads: 1, 2, 4, ..., 128; SmolLM2's 9
    heads / 3 KV heads: 1, 3, 9)."""
    return tuple(tp for tp in allowed_tp_sizes(num_attention_heads, num_kv_heads)
                 if _divides_heads(num_attention_heads, num_kv_heads, tp))


def check_tp_divides_heads(num_attention_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise unless `tp` divides the heads, so that every rank holds as many.

    The engine runs an uneven split (`check_tp`), but its ranks then hold different numbers of
    heads and the rank with the most sets every step's pace; the planner proposes only tp that
    divide the heads (`tp_sizes_dividing_heads`) and says so of an uneven tp it is given. A tp
    up to the KV heads must divide them (the query heads follow their KV heads: 6 heads / 3 KV
    heads over tp=2 fall 4 + 2), a larger one the query heads.

    Raises:
        HeadSplitError: as `check_tp`, or tp does not divide the heads; the message says how
            many query heads the ranks would hold and lists the tp the planner proposes.
    """
    check_tp(num_attention_heads, num_kv_heads, tp)
    if _divides_heads(num_attention_heads, num_kv_heads, tp):
        return
    what = (f"num_kv_heads={num_kv_heads}" if tp <= num_kv_heads < num_attention_heads
            else f"num_attention_heads={num_attention_heads}")
    counts = sorted({len(attention_head_range(num_attention_heads, num_kv_heads, tp, r))
                     for r in range(tp)}, reverse=True)
    dividing = tp_sizes_dividing_heads(num_attention_heads, num_kv_heads)
    raise HeadSplitError(
        f"tp={tp} does not divide {what}: its ranks would hold "
        f"{' or '.join(map(str, counts))} query heads, and the rank with the most sets every "
        f"step's pace; tp that divide the heads: {', '.join(map(str, dividing))}")


class LayerSplitError(ValueError):
    """A pipeline-parallel degree the layers cannot be split over."""


def check_pp(num_layers: int, pp: int) -> None:
    """Raise unless `pp` stages split `num_layers` layers evenly: the rule of the default, equal
    split (explicit split points, `check_split_points`, allow any pp up to num_layers).

    Raises:
        LayerSplitError: a count is not positive or pp does not divide the layers; the message
            lists the allowed values.
    """
    if num_layers < 1 or pp < 1:
        raise LayerSplitError(f"num_layers={num_layers} and pp={pp} must both be >= 1")
    if num_layers % pp:
        allowed = ", ".join(str(d) for d in range(1, num_layers + 1) if num_layers % d == 0)
        raise LayerSplitError(f"pp={pp} does not divide num_layers={num_layers} into equal "
                              f"stages; allowed pp: {allowed}")


def check_num_stages(num_layers: int, pp: int) -> None:
    """Raise unless `pp` stages can each hold at least one of `num_layers` layers: the rule of
    a split at chosen points (`check_split_points`), which any pp up to the layers meets.

    Raises:
        LayerSplitError: a count is not positive, or pp exceeds the layers.
    """
    if num_layers < 1 or pp < 1:
        raise LayerSplitError(f"num_layers={num_layers} and pp={pp} must both be >= 1")
    if pp > num_layers:
        raise LayerSplitError(f"pp={pp} exceeds num_layers={num_layers}: a stage would hold "
                              "no layer")


def equal_split_points(num_layers: int, pp: int) -> tuple[int, ...]:
    """The default split's points: ``num_layers / pp`` layers per stage (see `check_pp`)."""
    check_pp(num_layers, pp)
    return tuple(s * (num_layers // pp) for s in range(1, pp))


def has_split_points_form(pp: int, points: object) -> bool:
    """Whether ``points`` has the form of split points for ``pp`` stages: a tuple of pp - 1
    strictly increasing ints >= 1 (the first layer of stages 1 .. pp - 1). Their range needs the
    model's layers: ``check_split_points``. The YAML config and the engine config check this."""
    return (isinstance(points, tuple) and len(points) == pp - 1
            and all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in points)
            and all(b > a for a, b in zip(points, points[1:], strict=False)))


def check_split_points(num_layers: int, pp: int, split_points: Sequence[int]) -> tuple[int, ...]:
    """Check explicit pipeline split points; return them as a tuple.

    A split point is the first layer of stages 1 .. pp - 1 (stage 0 starts at layer 0)::

        30 layers, pp=3, split_points (10, 22):   stage 0: 0..9   stage 1: 10..21   stage 2: 22..29

    Any ``pp`` up to ``num_layers`` can be split this way; only the equal default needs pp to
    divide the layers.

    Raises:
        LayerSplitError: a count is not positive, the points are not pp - 1 ints, not strictly
            increasing, or outside 1 .. num_layers - 1 (which would leave a stage no layer).
    """
    check_num_stages(num_layers, pp)
    points = tuple(split_points)
    shown = list(points)
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in points):
        raise LayerSplitError(f"pipeline_split_points={shown} must be ints: the first layer "
                              f"index of stages 1..{pp - 1}")
    if len(points) != pp - 1:
        raise LayerSplitError(f"pipeline_split_points={shown} has {len(points)} point(s), but "
                              f"pp={pp} stages need {pp - 1}: the first layer of each stage "
                              "after stage 0")
    if any(p < 1 or p >= num_layers for p in points):
        raise LayerSplitError(f"pipeline_split_points={shown}: each point must be in "
                              f"1..{num_layers - 1} ({num_layers} layers; stage 0 starts at "
                              "layer 0 and every stage holds at least one layer)")
    if any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise LayerSplitError(f"pipeline_split_points={shown} must be strictly increasing "
                              "(every stage holds at least one layer)")
    return points


def stage_layer_ranges(num_layers: int, pp: int,
                       split_points: Sequence[int] | None = None) -> tuple[range, ...]:
    """Every stage's layers, in stage order: `stage_layer_range` for stages 0 .. pp - 1."""
    points = (equal_split_points(num_layers, pp) if split_points is None
              else check_split_points(num_layers, pp, split_points))
    bounds = (0, *points, num_layers)
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:], strict=False))


def stage_layer_range(num_layers: int, pp: int, stage: int,
                      split_points: Sequence[int] | None = None) -> range:
    """The decoder layers pipeline stage `stage` of `pp` runs: contiguous, ``num_layers / pp``
    each by default, or cut at ``split_points`` (see `check_split_points`). Stage 0 holds the
    embedding, stage pp - 1 the final norm and LM head.

    Raises:
        LayerSplitError: see `check_pp` (no split points) or `check_split_points`, or `stage`
            outside 0 .. pp - 1.
    """
    ranges = stage_layer_ranges(num_layers, pp, split_points)
    if not 0 <= stage < pp:
        raise LayerSplitError(f"stage={stage} is outside 0..{pp - 1} for pp={pp}")
    return ranges[stage]
