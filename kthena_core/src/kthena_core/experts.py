"""Experts: how a mixture-of-experts layer's routed experts are split over instances (wide
expert parallelism, EP), and how many distinct experts a batch reads.

Wide EP is the planner's (``kthena plan --wide-ep``); the serving engine does not run it. The
engine's ``--enable-expert-parallel`` puts each expert whole on one of an instance's TP ranks
instead of slicing it over all of them, which holds and reads the same bytes per rank, so the
planner prices it as TP and it is no layout of its own.

EP groups ``ep`` of a layout's ``dp`` instances: consecutive replicas, rank by rank (the same
TP index and pipeline stage). A group holds one copy of every MoE layer's routed experts:
instance i of the group holds experts ``i x E/ep .. (i+1) x E/ep - 1``, TP-sharded over its tp
ranks as a dense MLP is. Attention, the dense layers, the router, the shared experts, the
embedding and the LM head stay whole in every instance (TP-sharded). A token's hidden state
goes to the instances holding its top-k experts and comes back (dispatch and combine: an
all-to-all over the group), so a group's instances step together::

    TP2 x PP1 x DP4 (EP2), 8 experts: 4 instances of 2 ranks, 2 EP groups

    instance     0          1       |      2          3
    ranks      r0 r1      r2 r3     |    r4 r5      r6 r7
    experts     0-3        4-7      |     0-3        4-7
               `--- EP group 0 ---' |   `--- EP group 1 ---'

Weights per device: the rest of its layers / tp + the routed experts / (tp x ep). ``ep = 1`` is
plain TP: every instance holds every expert. ``ep`` must divide both ``dp`` (a group is whole
instances) and the number of experts (each instance holds as many).
"""

from __future__ import annotations

__all__ = ["ExpertSplitError", "allowed_ep_sizes", "check_ep", "expected_experts_read"]


class ExpertSplitError(ValueError):
    """An expert-parallel degree the model's experts or the layout's instances cannot take."""


def allowed_ep_sizes(num_experts: int, dp: int) -> tuple[int, ...]:
    """Every ep `check_ep` accepts for ``dp`` instances: 1, and for a MoE model (``num_experts``
    > 0) the common divisors of ``dp`` and ``num_experts``."""
    if num_experts < 1:
        return (1,)
    return tuple(e for e in range(1, dp + 1) if dp % e == 0 and num_experts % e == 0)


def check_ep(num_experts: int, ep: int, dp: int) -> None:
    """Raise unless ``ep`` instances of ``dp`` can share one copy of ``num_experts`` experts.

    Args:
        num_experts: routed experts per MoE layer (0: a dense model).
        ep: instances per EP group.
        dp: instances of the layout.
    Raises:
        ExpertSplitError: ep < 1; ep > 1 on a dense model; ep does not divide dp or the experts.
            The message lists the allowed ep.
    """
    allowed = ", ".join(map(str, allowed_ep_sizes(num_experts, dp)))
    if ep < 1:
        raise ExpertSplitError(f"ep={ep} must be >= 1; allowed ep: {allowed}")
    if ep == 1:
        return
    if num_experts < 1:
        raise ExpertSplitError(f"ep={ep} needs routed experts, and the model is dense; allowed "
                               "ep: 1")
    if dp % ep:
        raise ExpertSplitError(f"ep={ep} does not divide dp={dp}: an EP group is ep whole "
                               f"instances; allowed ep: {allowed}")
    if num_experts % ep:
        raise ExpertSplitError(f"ep={ep} does not divide the {num_experts} experts: each "
                               f"instance of an EP group holds as many; allowed ep: {allowed}")


def expected_experts_read(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Expected distinct experts ``num_tokens`` tokens are routed to, each to ``top_k`` of
    ``num_experts``, uniformly and independently: ``E x (1 - (1 - k/E)^n)``.

    One token reads exactly ``top_k`` experts; a large batch reads nearly all of them. A real
    router is not uniform (it favours some experts), so a batch reads somewhat fewer; this is
    the upper figure a decode step's weight traffic is priced with.
    """
    if num_experts < 1 or num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
