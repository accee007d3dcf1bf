"""The routed experts in float64, with a first-order bound on the error of computing them in a
given dtype; shares no code with mooncake_ops.moe.

The bound follows each rounding of the computation (Higham's gamma_n = n u / (1 - n u) for a
float32-accumulated dot product of length n, u the unit roundoff) per token-expert pair:

    z = W_gu x         |dz| <= gamma_H |W_gu| |x| + u_c |z|                 (output rounded)
    a = silu(g) * v    |da| <= 1.1 |dg| (|v| + |dv|) + |silu(g)| |dv| + 4 u_c |a|
                              (|silu'| <= 1.0999; silu and the product rounded, silu's own
                              approximation within a few ulps)
    y = W_d a          |dy| <= |W_d| |da| + gamma_I |W_d| |a| + u_c |y|
    out = sum_j w_j y_j  |dout| <= sum |w_j| |dy_j| + gamma_(k+1) sum |w_j y_j| + u_o |out|

with u_c the unit roundoff of the dtype the intermediates are kept in and u_o that of the
output. Inputs are taken as given (already rounded to their dtype): the bound is of the
arithmetic, not of rounding the inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SILU_SLOPE = 1.1


def gamma(n: int) -> float:
    u = UNIT_ROUNDOFF[torch.float32]
    return n * u / (1 - n * u)


def experts64(x, weights, ids, gate_up, down, *, compute_dtype, out_dtype, expert_start=0,
              extra_sums=0):
    """(out [T, H] float64, bound [T, H]): the weighted expert MLPs of the pairs whose expert
    is one of ``gate_up``'s (ids ``expert_start ..``), and the error bound of computing them
    with intermediates in ``compute_dtype`` and the result rounded to ``out_dtype``;
    ``extra_sums`` more float32 additions of partial sums (an all-reduce over that many + 1
    ranks) widen the weighted sum's gamma."""
    u_c, u_o = UNIT_ROUNDOFF[compute_dtype], UNIT_ROUNDOFF[out_dtype]
    tokens, hidden = x.shape
    inter = down.shape[2]
    out = torch.zeros(tokens, hidden, dtype=torch.float64)
    err = torch.zeros_like(out)
    spread = torch.zeros_like(out)  # sum_j |w_j y_j|
    for t in range(tokens):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - expert_start
            if not 0 <= e < gate_up.shape[0]:
                continue
            w = float(weights[t, j])
            y, dy = _pair(x[t].double(), gate_up[e].double(), down[e].double(), inter, u_c)
            out[t] += w * y
            err[t] += abs(w) * dy
            spread[t] += abs(w * y)
    return out, err + gamma(ids.shape[1] + 1 + extra_sums) * spread + u_o * out.abs()


def _pair(x, w_gu, w_d, inter, u_c):
    z = w_gu @ x
    dz = gamma(x.numel()) * (w_gu.abs() @ x.abs()) + u_c * z.abs()
    g, v, dg, dv = z[:inter], z[inter:], dz[:inter], dz[inter:]
    s = F.silu(g)
    a = s * v
    da = SILU_SLOPE * dg * (v.abs() + dv) + s.abs() * dv + 4 * u_c * a.abs()
    y = w_d @ a
    dy = w_d.abs() @ da + gamma(inter) * (w_d.abs() @ a.abs()) + u_c * y.abs()
    return y, dy


def assert_within(actual, expected, bound, what: str) -> None:
    """|actual - expected| <= bound everywhere (float64), naming the worst element."""
    assert not actual.isnan().any(), f"{what}: NaN in the output"
    diff = (actual.double() - expected.double()).abs()
    over = diff > bound
    if bool(over.any()):
        ratio = (diff / bound.clamp_min(1e-300)).max().item()
        t, h = (int(i) for i in over.nonzero()[0])
        raise AssertionError(f"{what}: |error| {diff[t, h].item():.3g} > bound "
                             f"{bound[t, h].item():.3g} at [{t}, {h}] (worst ratio {ratio:.3g})")
