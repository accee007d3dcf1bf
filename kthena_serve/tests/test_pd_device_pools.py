"""PD pools by device (pd/pool_share.py): how a decode pool is exported and opened, and what
is refused, checked on this CPU machine.

What runs here for real: the cpu route (a /dev/shm pool exported by name and opened), the
pool-handle exchange for the cuda route (``CudaIpcExport`` through JSON, its validation, its
argument order against the installed torch's ``rebuild_cuda_tensor``), and every refusal. The
cuda route's opening (torch's CUDA IPC) needs a GPU: ``scripts/gpu_check.py`` runs it
(``pd_device_pools``), and tests/test_gpu_check.py runs that step's code on cpu. The prefill
side's hand-off over a shm pool (``PrefillExecutor.submit_shared`` -> ``open_pool``) runs in
test_pd_batched_prefill.py and test_pd.py.
"""

from __future__ import annotations

import inspect
import json

import attrs
import pytest
import torch

from kthena_comm.errors import TransportUnavailableError
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import create_pool, kv_layout_for
from kthena_serve.pd.config import PDConfig, Transport
from kthena_serve.pd.pool_share import (
    CudaIpcExport,
    PoolShareError,
    export_pool,
    open_pool,
    pool_key,
    share_for,
)
from kthena_serve.pd.protocol import PoolRef, PrefillTask
from kthena_serve.pd.transfer import BlockGetter, mooncake_config_for, shm_engine
from kthena_serve.spec import ServeSpec
from mooncake_kv import shared_pool_paths

CONFIG = EngineConfig(num_kv_blocks=8, dtype="float32")
STORAGE_BYTES = 1 << 20


@pytest.fixture
def layout():
    return kv_layout_for(2, 2, 8, CONFIG)


@pytest.fixture
def shared_pool(layout):
    pool = create_pool(layout, CONFIG, shared=True)
    yield pool
    pool.close()


def _ref(layout, **where) -> PoolRef:  # noqa: ANN001
    return PoolRef(layout.num_blocks, CONFIG.block_size, CONFIG.dtype, **where)


def _reduction(num_bytes: int, event: bytes | None = b"e" * 64) -> tuple:
    """An argument tuple in the order torch's reducer gives for a CUDA tensor (built by hand:
    this machine has no CUDA to share from)."""
    return (torch.Tensor, torch.Size([num_bytes]), (1,), 256, torch.UntypedStorage, torch.uint8,
            0, b"h" * 64, STORAGE_BYTES, 4096, False, b"/torch_1234_5678_0", 3, event, True)


# ---- cpu: the shm route ---------------------------------------------------------------------------
def test_a_cpu_decode_pool_is_exported_by_name_and_opened_as_the_same_bytes(layout, shared_pool):
    fields = export_pool(shared_pool)
    assert fields == {"shm_name": shared_pool.name}
    ref = _ref(layout, **fields)
    assert pool_key(ref) == f"shm:{shared_pool.name}"
    opened = open_pool(ref, layout)
    try:
        assert not opened.is_owner
        opened.k_cache(1)[3].fill_(2.5)  # the prefill side writes a block ...
        assert torch.all(shared_pool.k_cache(1)[3] == 2.5)  # ... the decode side reads it
        assert not torch.any(shared_pool.k_cache(1)[2])
    finally:
        opened.close()
    assert shared_pool.name in {p.name for p in shared_pool_paths()}  # only the owner unlinks


def test_an_unshared_cpu_pool_cannot_be_exported(layout):
    pool = create_pool(layout, CONFIG)
    try:
        with pytest.raises(PoolShareError, match="created shared"):
            export_pool(pool)
    finally:
        pool.close()


def test_a_task_naming_no_pool_is_refused_naming_the_mooncake_transport(layout):
    for call in (open_pool, pool_key):
        with pytest.raises(PoolShareError, match="mooncake transport"):
            call(_ref(layout), *((layout,) if call is open_pool else ()))


# ---- cuda: the pool-handle exchange (JSON), checked without a GPU ---------------------------------
def test_the_cuda_ipc_export_survives_json_and_rebuilds_torchs_arguments(layout):
    args = _reduction(layout.total_bytes)
    export = CudaIpcExport.from_reduction(args)
    wire = json.loads(json.dumps(PrefillTask("r", (1, 2), 0, (0,), {},
                                             _ref(layout, device_ipc=export.to_json())).to_json()))
    back = PrefillTask.from_json(wire).pool
    assert CudaIpcExport.from_json(back.device_ipc) == export
    rebuilt = export.rebuild_args()
    assert rebuilt[1] == (layout.total_bytes,) and rebuilt[2] == (1,)
    assert rebuilt[3:] == (256, torch.UntypedStorage, torch.uint8, *args[6:10], False,
                           *args[11:])


def test_the_rebuild_arguments_follow_the_installed_torchs_signature():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(names) == len(CudaIpcExport.from_reduction(_reduction(64)).rebuild_args())
    assert names[7] == "storage_handle" and names[8] == "storage_size_bytes"
    assert names[11] == "ref_counter_handle" and names[13] == "event_handle"


def test_a_cuda_pool_key_names_the_allocation_and_offset(layout):
    one = _ref(layout, device_ipc=CudaIpcExport.from_reduction(_reduction(64)).to_json())
    other = attrs.evolve(CudaIpcExport.from_reduction(_reduction(64)), storage_offset_bytes=0)
    keys = {pool_key(one), pool_key(_ref(layout, device_ipc=other.to_json()))}
    assert len(keys) == 2 and all(k.startswith("cuda:0:") for k in keys)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("num_bytes"), "fields"),
    (lambda d: d.update(extra=1), "fields"),
    (lambda d: d.update(storage_offset_bytes=-1), ">= 0"),
    (lambda d: d.update(num_bytes=STORAGE_BYTES), "past the end"),
    (lambda d: d.update(storage_handle="not base64!"), "storage_handle is not base64"),
    (lambda d: d.update(event_handle=7), "event_handle is not base64"),
])
def test_a_malformed_cuda_ipc_export_is_refused(change, message):
    data = CudaIpcExport.from_reduction(_reduction(64)).to_json()
    change(data)
    with pytest.raises(PoolShareError, match=message):
        CudaIpcExport.from_json(data)
    with pytest.raises(PoolShareError, match="must be an object"):
        CudaIpcExport.from_json([1])


def test_opening_a_cuda_pool_here_is_refused_by_size_then_for_want_of_cuda(layout):
    assert not torch.cuda.is_available()  # this machine; on a GPU host gpu_check opens one
    wrong = _ref(layout, device_ipc=CudaIpcExport.from_reduction(_reduction(64)).to_json())
    with pytest.raises(PoolShareError, match="same model, dtype and block size"):
        open_pool(wrong, layout)
    right = CudaIpcExport.from_reduction(_reduction(layout.total_bytes)).to_json()
    with pytest.raises(PoolShareError, match="no CUDA device"):
        open_pool(_ref(layout, device_ipc=right), layout)


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", list(Transport))
def test_pd_takes_cpu_and_cuda_on_both_transports_npu_over_mooncake_only(transport):
    PDConfig.check_device("cpu", transport)
    PDConfig.check_device("cuda:0", transport)
    for device in ("npu", "npu:3"):
        if transport is Transport.MOONCAKE:
            PDConfig.check_device(device, transport)  # ascend_direct: documentation only
            continue
        with pytest.raises(PoolShareError, match="same-host route is not wired on npu") as no:
            PDConfig.check_device(device, transport)
        assert "no released IPC for NPU memory" in str(no.value)
        assert "--pd-transport mooncake" in str(no.value)
    with pytest.raises(PoolShareError, match="no PD pool route for 'xpu'"):
        PDConfig.check_device("xpu", transport)
    with pytest.raises(PoolShareError, match="no released IPC for NPU memory"):
        share_for("npu:0")
    assert share_for("cuda:1").device_type == "cuda" and share_for("cpu").device_type == "cpu"


def test_serve_refuses_pd_on_npu_over_shm_before_anything_starts():
    with pytest.raises(ValueError, match=r"--mode pd --device npu --pd-transport shm: the "
                                         r"same-host route is not wired on npu"):
        ServeSpec.resolve({"mode": "pd", "device": "npu"})
    # over mooncake the PD check passes; this host then lacks the NPU itself
    with pytest.raises(ValueError, match=r"--device: EngineConfig.device must be a device "
                                         r"this host has"):
        ServeSpec.resolve({"mode": "pd", "device": "npu:1", "pd_transport": "mooncake"})
    with pytest.raises(ValueError, match="PD settings"):  # PDConfig's message, not ours
        ServeSpec.resolve({"mode": "pd", "pd_transport": "carrier-pigeon"})
    assert ServeSpec.resolve({"mode": "pd"}).engine.device == "cpu"


def test_mooncake_takes_tcp_for_host_and_cuda_pools_and_ascend_direct_for_npu():
    for device in ("cpu", "cuda:1", torch.device("cpu")):
        config = mooncake_config_for(device, "127.0.0.1", 30.0)
        assert config.protocol == "tcp" and config.ascend is None
    config = mooncake_config_for("npu:3", "10.0.0.5", 30.0)
    assert config.protocol == "ascend" and config.ascend.device_id == 3
    assert config.host == "10.0.0.5"  # the bare host, as ascend_direct takes it
    with pytest.raises(ValueError, match="must exceed"):  # the transport's own deadline
        mooncake_config_for("npu:0", "10.0.0.5", 5.0)


def test_create_pool_shares_cpu_in_shm_and_refuses_a_device_without_a_route(layout):
    pool = create_pool(layout, CONFIG, shared=True)
    try:
        assert pool.is_shared and pool.buffer.device.type == "cpu"
    finally:
        pool.close()
    with pytest.raises(ValueError, match="shared KV pool on meta is not supported"):
        create_pool(layout, CONFIG, shared=True, device="meta")
    private = create_pool(layout, CONFIG, device="meta")  # unshared: any device torch has
    assert not private.is_shared and private.buffer.device.type == "meta"


def test_pulling_into_a_device_pool_over_shm_is_refused_naming_mooncake(layout):
    engine = shm_engine(1.0)
    try:
        getter = BlockGetter(engine, None, layout, 1.0)  # a device pool: nothing registered
        with pytest.raises(TransportUnavailableError, match="--pd-transport mooncake"):
            getter.get(None, layout, [0], [1])
    finally:
        engine.close()


def test_the_decode_worker_publishes_its_cpu_pool_by_name(shared_pool):
    from kthena_serve.pd.decode_server import _decode_pool

    engine, handle, ref = _decode_pool(shared_pool, CONFIG, PDConfig(), None)
    try:
        assert ref.shm_name == shared_pool.name and ref.device_ipc is None
        assert ref.mooncake_handle is None and handle is not None
        assert pool_key(ref) == f"shm:{shared_pool.name}"
    finally:
        engine.close()
