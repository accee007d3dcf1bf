"""HCCL communicator names: what CANN's MC2 kernels (matmul fused with a collective) take.

torch_npu's fused ops (``npu_mm_all_reduce_base`` ...) address a group by its HCCL communicator
name, got from the group's HCCL backend: ``group._get_backend(npu).get_hccl_comm_name(rank)``.
torch_npu documents ``rank`` as the *global* rank (unique across machines), for the default
group and for groups from ``new_group`` alike, and asks for the current device to be set first
(op-plugin docs, ``torch-distributed-distributed_c10d.md``). ``init_parallel_groups`` stores
each group's name in ``CommGroup.hccl_comm_name`` when the backend is hccl, so ops read it from
the group they are given instead of each reaching into torch.distributed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hccl_comm_name"]


def hccl_comm_name(process_group: Any, global_rank: int, device: Any = None) -> str:
    """The HCCL communicator name of ``process_group`` seen from this process.

    Args:
        process_group: a torch ``ProcessGroup`` created with the hccl backend.
        global_rank: this process's rank in the world (not inside the group).
        device: the npu device to look the backend up by (default ``torch.device("npu")``,
            which exists once torch_npu is imported).

    Raises:
        ValueError: the group has no HCCL backend (it was not created with backend "hccl").
    """
    if device is None:
        import torch

        device = torch.device("npu")
    try:
        backend = process_group._get_backend(device)
        return str(backend.get_hccl_comm_name(global_rank))
    except (AttributeError, RuntimeError) as exc:
        raise ValueError(f"process group {process_group!r} has no HCCL backend ({exc}); MC2 "
                         "ops need a group created by init_parallel_groups on npu "
                         "(backend hccl)") from exc
