"""What int8 KV costs in accuracy, on activations shaped like a real Llama layer's.

The figures are printed (``pytest -s``) and bounded loosely (they are a report, and a regression
guard against a broken quantiser, not a target). Measured: SmolLM2 shape ~3e-2 relative L2 for
int8 vs ~3e-3 for bf16 (4 outlier channels squeeze the other channels' int8 steps); Llama-70B
per-rank shape ~8e-3 for both. The benchmark reports the same measure.
"""

from __future__ import annotations

import pytest
from _mops_support import IMPLS, using

from mooncake_ops.bench import SHAPES, int8_error


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_int8_kv_error_vs_bf16(name, shape):
    with using(name):
        row = int8_error(512, SHAPES[shape], seed=1)
    print(f"\n{name} {shape}: bf16 rel L2 {row['bf16_rel_l2']:.2e}, int8 rel L2 "
          f"{row['int8_rel_l2']:.2e} (max abs {row['int8_max_abs']:.2e})")
    assert row["bf16_rel_l2"] < 1e-2
    assert row["int8_rel_l2"] < 6e-2
