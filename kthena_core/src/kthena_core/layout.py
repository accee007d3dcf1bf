"""Layout: one parallel layout, the sizes of its TP, PP, DP and SP groups, spelled tp / pp / dp / sp.

The planner enumerates and scores these, kthena_comm builds a rank's process groups from one,
and ``kthena serve`` reports the one it runs: one value, one spelling. Rank order (kthena_comm's
group arithmetic) puts TP innermost, then PP, then DP::

    global rank = (dp_idx * pp + pp_idx) * tp + tp_idx       tp=2, pp=1, dp=2: TP [0 1] [2 3]
                                                                                  DP [0 2] [1 3]

Sequence parallelism (Megatron style) runs over the TP group, so ``sp`` is 1 or ``tp`` and needs
no devices of its own. Expert parallelism (MoE models, an `ExpertLayout`) groups ``ep`` of the
``dp`` instances, which then share one copy of the routed experts (`kthena_core.experts`); it
needs no devices of its own either, so ``ep`` divides ``dp`` and the device count stays
tp x pp x dp. ``label`` writes the overlays in parentheses, after the sizes that multiply to the
devices::

    TP8 x PP1 x DP4 (EP4)     32 devices: 4 instances of TP8, all 4 sharing one copy of the experts
    TP8 x PP1 x DP1 (SP8)      8 devices: one TP8 instance, its prompts' tokens split over the 8

A disaggregated (PD) deployment runs two kinds of instance, each with its own size: a `PDLayout`
holds a `Layout` per role, ``dp`` being that role's instance count. Ranks are laid prefill
instances first, then decode instances, each instance TP-innermost as above::

    prefill 1 x TP4 + decode 1 x TP4     ranks 0-3: the prefill instance, 4-7: the decode one
    prefill 2 x TP2 + decode 1 x TP4     ranks 0-1, 2-3: prefill instances, 4-7: decode
"""

from __future__ import annotations

import attrs

__all__ = ["ExpertLayout", "Layout", "LayoutError", "PDLayout", "RoleInstance", "sp_refusal",
           "sp_with_pp_refusal", "with_ep"]


class LayoutError(ValueError):
    """A parallel layout that cannot exist (a size that is not a positive int, SP neither 1
    nor TP), or one that does not fit the ranks it is used with."""


def sp_refusal(tp: int, pp: int, sp: int) -> str | None:
    """Why sequence parallelism ``sp`` cannot run at ``tp`` x ``pp``, or None when it can: the
    one home of SP's rules, which the YAML config, the planner, ``kthena deploy``, the engine
    config and the model all call. SP runs over the TP group (``sp`` is 1 or ``tp``), and not
    with pipeline stages."""
    if sp not in (1, tp):
        return (f"sp={sp} must be 1 or equal tp={tp}: sequence parallelism runs over the "
                "tensor-parallel group")
    return sp_with_pp_refusal(pp) if sp > 1 else None


def sp_with_pp_refusal(pp: int) -> str | None:
    """Why sequence parallelism cannot run with ``pp`` pipeline stages, or None (``pp`` 1)."""
    if pp > 1:
        return (f"sequence parallelism with pipeline parallelism (pp={pp}) is not wired: a "
                "stage would hand the next a sharded residual stream")
    return None


def _positive(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class Layout:
    """One parallel layout: TP x PP x SP within a replica, DP replicas.

    Attributes:
        tp: tensor-parallel ranks (each holds a share of every layer's heads).
        pp: pipeline stages (each holds a contiguous run of layers).
        dp: replicas.
        sp: sequence-parallel ranks: 1, or ``tp`` (SP runs over the TP group).
        ep: (a property) 1: every instance holds every expert; see `ExpertLayout`.

    Raises:
        LayoutError: a size is not a positive int, or ``sp`` is neither 1 nor ``tp``.
    """

    tp: int = attrs.field(validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)
    dp: int = attrs.field(default=1, validator=_positive)
    sp: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.sp not in (1, self.tp):  # SP with PP is a layout the planner prices, then drops
            raise LayoutError(sp_refusal(self.tp, self.pp, self.sp))

    @property
    def ep(self) -> int:
        """Instances per expert-parallel group: 1 (an `ExpertLayout` has more)."""
        return 1

    def sp_refusal(self) -> str | None:
        """Why this layout's SP cannot run (``sp_refusal``), or None."""
        return sp_refusal(self.tp, self.pp, self.sp)

    def __str__(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} sp={self.sp}"
                + (f" ep={self.ep}" if self.ep > 1 else ""))

    @property
    def label(self) -> str:
        """``TP8 x PP1 x DP4`` with the overlays in parentheses (``(EP4, SP8)``): what plans,
        reports and deploy messages print."""
        overlays = [f"{name}{size}" for name, size in (("EP", self.ep), ("SP", self.sp))
                    if size > 1]
        text = f"TP{self.tp} x PP{self.pp} x DP{self.dp}"
        return text + (f" ({', '.join(overlays)})" if overlays else "")

    @property
    def num_devices(self) -> int:
        """Ranks the layout needs: tp x pp x dp (SP shares the TP ranks)."""
        return self.tp * self.pp * self.dp

    @property
    def device_mapping(self) -> tuple[int, int, int]:
        """(tp, pp, dp): which devices each rank and group gets. SP does not change it."""
        return (self.tp, self.pp, self.dp)

    @property
    def order_key(self) -> tuple[int, ...]:
        """The planner's tie-break after cost and devices: smaller tp, pp, no sp, no ep."""
        return (self.tp, self.pp, self.sp, self.ep)

    def instances(self) -> tuple[RoleInstance, ...]:
        """Each of the ``dp`` instances, where its ranks start (all role ``"serve"``)."""
        size = self.tp * self.pp
        return tuple(RoleInstance("serve", i * size, self.tp, self.pp) for i in range(self.dp))


@attrs.frozen
class ExpertLayout(Layout):
    """A layout with wide expert parallelism: ``ep`` of its ``dp`` instances share one copy of
    a MoE model's routed experts (`kthena_core.experts`). Only the planner makes these, for MoE
    models; a plain `Layout` is ``ep = 1``, and its dict form (what the engine, kthena_comm and
    ``GET /plan`` carry) has no ``ep`` key.

    Raises:
        LayoutError: as `Layout`, or ``ep`` is < 2 (a plain `Layout` is ep 1) or does not
            divide ``dp``.
    """

    ep: int = attrs.field(kw_only=True)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 2:
            raise LayoutError(f"ep must be an int >= 2 (a plain Layout is ep 1), got {self.ep!r}")
        if self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp={self.dp}: an expert-parallel "
                              "group is ep whole instances")


def with_ep(layout: Layout, ep: int) -> Layout:
    """`layout` with ``ep`` instances per expert-parallel group: an `ExpertLayout`, or the plain
    `Layout` of its sizes when ``ep`` is 1."""
    sizes = (layout.tp, layout.pp, layout.dp, layout.sp)
    return Layout(*sizes) if ep == 1 else ExpertLayout(*sizes, ep=ep)


@attrs.frozen
class RoleInstance:
    """One engine of a layout: its role, its first rank, and its tp x pp ranks from there."""

    role: str
    first_rank: int
    tp: int
    pp: int


def _role_layout(_inst: object, attribute: attrs.Attribute, value: Layout) -> None:
    if type(value) is not Layout:
        raise LayoutError(f"PDLayout.{attribute.name} must be a plain Layout (no expert "
                          f"parallelism), got {value!r}")
    if value.sp != 1:
        raise LayoutError(f"PDLayout.{attribute.name}: sp={value.sp}; allowed: 1 (sequence "
                          "parallelism is not wired in PD workers)")


@attrs.frozen
class PDLayout:
    """A disaggregated layout: the prefill role's and the decode role's, each a `Layout` whose
    ``dp`` is that role's instance count (so ``prefill.tp`` x ``prefill.pp`` devices per prefill
    instance). Prefill is compute-bound (its instances set TTFT), decode bandwidth-bound (its
    set TPOT), so each role has its own size.

    The sizes a reader of one `Layout` asks for are answered for the whole deployment:
    ``num_devices`` (both roles'), ``dp`` (every instance), ``tp`` / ``pp`` (the larger role's:
    what "does any worker run TP" reads), ``sp`` and ``ep`` 1. `as_layout` is that as a plain
    `Layout`, for a reader that knows only one.

    Raises:
        LayoutError: a role is not a plain Layout, or has sp > 1.
    """

    prefill: Layout = attrs.field(validator=_role_layout)
    decode: Layout = attrs.field(validator=_role_layout)

    @property
    def roles(self) -> tuple[tuple[str, Layout], tuple[str, Layout]]:
        """``(("prefill", layout), ("decode", layout))``, in rank order."""
        return (("prefill", self.prefill), ("decode", self.decode))

    @property
    def tp(self) -> int:
        return max(self.prefill.tp, self.decode.tp)

    @property
    def pp(self) -> int:
        return max(self.prefill.pp, self.decode.pp)

    @property
    def dp(self) -> int:
        """Every instance, prefill and decode."""
        return self.prefill.dp + self.decode.dp

    sp = property(lambda self: 1)
    ep = property(lambda self: 1)

    def sp_refusal(self) -> str | None:
        return None

    @property
    def num_devices(self) -> int:
        return self.prefill.num_devices + self.decode.num_devices

    @property
    def device_mapping(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Each role's (tp, pp, instances): which devices each rank and group gets."""
        return (self.prefill.device_mapping, self.decode.device_mapping)

    @property
    def order_key(self) -> tuple[int, ...]:
        """The planner's tie-break after cost, TTFT and devices: smaller tp and pp, then the
        roles' sizes (so no two layouts tie)."""
        p, d = self.prefill, self.decode
        return (self.tp, self.pp, p.tp, p.pp, p.dp, d.tp, d.pp, d.dp)

    def as_layout(self) -> Layout:
        """One `Layout` standing for the deployment: the larger role's tp and pp, every
        instance as dp. Exact when both roles have one size (``TP4 x PP1 x DP2`` for 1 + 1
        TP4 instances)."""
        return Layout(self.tp, self.pp, self.dp)

    def instances(self) -> tuple[RoleInstance, ...]:
        """The prefill instances, then the decode ones, with the rank each starts at."""
        out, rank = [], 0
        for role, lay in self.roles:
            for _ in range(lay.dp):
                out.append(RoleInstance(role, rank, lay.tp, lay.pp))
                rank += lay.tp * lay.pp
        return tuple(out)

    @staticmethod
    def role_label(layout: Layout) -> str:
        """``TP4`` or ``TP2 x PP2``: one instance's size."""
        return f"TP{layout.tp}" + (f" x PP{layout.pp}" if layout.pp > 1 else "")

    @property
    def label(self) -> str:
        """``prefill 1 x TP4 + decode 1 x TP4``: instances x each one's size, per role."""
        return " + ".join(f"{role} {lay.dp} x {self.role_label(lay)}" for role, lay in self.roles)

    def __str__(self) -> str:
        return " ".join(f"{role}:tp={lay.tp},pp={lay.pp},count={lay.dp}"
                        for role, lay in self.roles)
