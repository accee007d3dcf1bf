"""KVPool: bytes written through the layout's ranges read back through the tensor views,
shared memory seen by a second process, and no /dev/shm leftovers."""

import ctypes
import gc
import os
import pickle
import stat
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from mooncake_kv import shared_pool_paths  # noqa: E402
from mooncake_kv.layout import KVLayout, KVPart, LayerIndexError, LayoutKind  # noqa: E402
from mooncake_kv.pool import (  # noqa: E402
    SHM_DIR,
    BlockPayloadError,
    KVPool,
    KVPoolHandle,
    PoolClosedError,
    PoolExistsError,
    PoolMismatchError,
    PoolNotFoundError,
    torch_dtype,
)
from mooncake_kv.sizing import KVShape  # noqa: E402

torch.set_num_threads(1)
PREFIX = f"mooncake_kv.{os.getpid()}."
DTYPES = ["bf16", "fp16", "fp32", "int8"]


def small_shape(dtype="bf16") -> KVShape:
    return KVShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


def our_shm_files() -> set[str]:
    return {path.name for path in shared_pool_paths(os.getpid())}


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    before = our_shm_files()
    yield
    gc.collect()
    assert our_shm_files() == before


def random_bytes(n: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).tolist())


def view_bytes(view: torch.Tensor) -> bytes:
    flat = view.contiguous().view(torch.uint8).flatten()
    return ctypes.string_at(flat.data_ptr(), flat.numel())


@pytest.mark.parametrize("kind", list(LayoutKind))
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_written_at_layout_addresses_read_back_through_views(kind, dtype):
    layout = KVLayout(small_shape(dtype), 5, kind)
    with KVPool.create(layout) as pool:
        written = {}
        for layer in range(3):
            for part in KVPart:
                seg = layout.segment(3, layer, part)
                written[(layer, part)] = random_bytes(seg.length, seed=layer * 2 + part)
                ctypes.memmove(pool.base_address + seg.offset, written[(layer, part)], seg.length)
        for layer in range(3):
            assert view_bytes(pool.k_cache(layer)[3]) == written[(layer, KVPart.K)]
            assert view_bytes(pool.v_cache(layer)[3]) == written[(layer, KVPart.V)]
            assert view_bytes(pool.k_cache(layer)[2]) == bytes(layout.unit_bytes)  # untouched
        assert sum(map(len, written.values())) == layout.shape.element_bytes_per_token * 4


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_int8_scales_written_through_views_land_at_scale_segments(kind):
    layout = KVLayout(small_shape("int8"), 4, kind)
    with KVPool.create(layout) as pool:
        scales = torch.arange(4 * 2, dtype=torch.float32).reshape(4, 2) + 0.5
        pool.v_scale(2)[1] = scales
        pool.k_cache(2)[1] = torch.full((4, 2, 8), -7, dtype=torch.int8)
        seg = layout.scale_segment(1, 2, KVPart.V)
        assert ctypes.string_at(pool.base_address + seg.offset, seg.length) == view_bytes(scales)
        seg = layout.segment(1, 2, KVPart.K)
        assert pool.buffer[seg.offset : seg.end].view(torch.int8).eq(-7).all()
        assert pool.k_scale(0).shape == (4, 4, 2) and pool.k_scale(0).dtype == torch.float32


@pytest.mark.parametrize("kind", list(LayoutKind))
@pytest.mark.parametrize("dtype", DTYPES)
def test_views_have_attention_shape_and_dtype(kind, dtype):
    with KVPool.create(KVLayout(small_shape(dtype), 6, kind)) as pool:
        for layer in range(3):
            for view in (pool.k_cache(layer), pool.v_cache(layer)):
                assert view.shape == (6, 4, 2, 8)
                assert view.dtype == torch_dtype(dtype)
                assert view[0].is_contiguous()  # one block of one layer is dense


def test_block_major_views_are_strided_and_per_layer_views_contiguous():
    shape = small_shape()
    with KVPool.create(KVLayout(shape, 6, LayoutKind.BLOCK_MAJOR)) as pool:
        assert not pool.k_cache(1).is_contiguous()
        assert pool.k_cache(1).stride(0) == 2 * 3 * 4 * 2 * 8
    with KVPool.create(KVLayout(shape, 6, LayoutKind.PER_LAYER)) as pool:
        assert pool.k_cache(1).is_contiguous()


@pytest.mark.parametrize("kind", list(LayoutKind))
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_read_write_block_roundtrip_between_pools(kind, dtype):
    layout = KVLayout(small_shape(dtype), 4, kind)
    with KVPool.create(layout) as src, KVPool.create(layout) as dst:
        src.buffer.random_(0, 256)
        dst.write_block(0, src.read_block(2))
        for layer in range(3):
            assert torch.equal(dst.k_cache(layer)[0].view(torch.uint8),
                               src.k_cache(layer)[2].view(torch.uint8))
            assert torch.equal(dst.v_cache(layer)[0].view(torch.uint8),
                               src.v_cache(layer)[2].view(torch.uint8))
        assert dst.read_block(1) == bytes(layout.bytes_per_block)
        with pytest.raises(BlockPayloadError, match="needs exactly"):
            dst.write_block(1, b"short")


def test_batch_addresses_are_base_plus_offsets():
    with KVPool.create(KVLayout(small_shape(), 8)) as pool:
        assert pool.batch_addresses([2, 3, 4]) == (
            (pool.base_address + 2 * pool.layout.bytes_per_block, 3 * pool.layout.bytes_per_block),
        )


def test_shared_pool_is_a_0600_file_unlinked_on_close():
    pool = KVPool.create(KVLayout(small_shape(), 4), shared=True)
    path = SHM_DIR / pool.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == pool.layout.total_bytes
    assert pool.is_shared and pool.is_owner
    pool.close()
    assert not path.exists() and pool.closed
    pool.close()  # harmless
    with pytest.raises(PoolClosedError, match="closed"):
        pool.k_cache(0)


def test_shared_pool_paths_find_default_named_pools_by_creator():
    layout = KVLayout(small_shape(), 4)
    with KVPool.create(layout, shared=True) as pool, KVPool.create(
        layout, shared=True, name=f"explicit-{os.getpid()}"
    ) as named:
        path = SHM_DIR / pool.name
        assert path in shared_pool_paths(os.getpid()) and path in shared_pool_paths()
        assert SHM_DIR / named.name not in shared_pool_paths()  # an explicit name is the caller's
        other = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True).stdout
        assert path not in shared_pool_paths(int(other))
    assert path not in shared_pool_paths(os.getpid())


def test_context_manager_unlinks_even_on_error():
    with pytest.raises(RuntimeError, match="boom"), KVPool.create(
        KVLayout(small_shape(), 4), shared=True
    ) as pool:
        name = pool.name
        raise RuntimeError("boom")
    assert not (SHM_DIR / name).exists()


def test_finalizer_unlinks_a_forgotten_pool():
    pool = KVPool.create(KVLayout(small_shape(), 4), shared=True)
    path = SHM_DIR / pool.name
    del pool
    gc.collect()
    assert not path.exists()


def test_views_survive_close_of_a_shared_pool():
    pool = KVPool.create(KVLayout(small_shape(), 4), shared=True)
    view = pool.k_cache(0)
    pool.close()
    view.fill_(1.0)  # mapping lives on with the view; only the name is gone
    assert view.sum().item() == 4 * 4 * 2 * 8


def test_attach_in_process_shares_bytes_and_never_unlinks():
    with KVPool.create(KVLayout(small_shape(), 4), shared=True) as owner:
        other = KVPool.attach(owner.handle)
        owner.k_cache(1)[2] = 3.0
        assert other.k_cache(1)[2].eq(3.0).all()
        other.v_cache(0)[0] = -1.0
        assert owner.v_cache(0)[0].eq(-1.0).all()
        assert not other.is_owner
        other.close()
        assert (SHM_DIR / owner.name).exists()


def test_second_process_sees_and_writes_the_same_bytes():
    layout = KVLayout(small_shape("int8"), 4, LayoutKind.BLOCK_MAJOR)
    with KVPool.create(layout, shared=True) as pool:
        pool.buffer.random_(0, 256)
        expected = pool.read_block(1)
        script = textwrap.dedent(
            """
            import pickle, sys
            from mooncake_kv.pool import KVPool
            handle = pickle.loads(bytes.fromhex(sys.argv[1]))
            with KVPool.attach(handle) as pool:
                assert pool.read_block(1) == bytes.fromhex(sys.argv[2]), "child saw other bytes"
                pool.k_cache(2)[3].fill_(42)
                pool.v_scale(0)[3].fill_(0.25)
            """
        )
        args = [pickle.dumps(pool.handle).hex(), expected.hex()]
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert pool.k_cache(2)[3].eq(42).all()
        assert pool.v_scale(0)[3].eq(0.25).all()
        assert pool.read_block(1) == expected


def test_shared_misuse():
    layout = KVLayout(small_shape(), 4)
    with pytest.raises(PoolNotFoundError, match="no shared pool named"):
        KVPool.attach(KVPoolHandle(PREFIX + "missing", layout))
    with KVPool.create(layout, shared=True) as pool:
        with pytest.raises(PoolExistsError, match="already exists"):
            KVPool.create(layout, shared=True, name=pool.name)
        with pytest.raises(PoolMismatchError, match="layout needs"):
            KVPool.attach(KVPoolHandle(pool.name, KVLayout(small_shape(), 5)))
    with pytest.raises(ValueError, match="not allowed"):
        KVPool.create(layout, shared=True, name="../etc/passwd")
    with pytest.raises(ValueError, match="only shared pools have a name"):
        KVPool.create(layout, name="x")
    with pytest.raises(ValueError, match="unshared pool has no handle"):
        _ = KVPool.create(layout).handle


def test_view_misuse():
    with KVPool.create(KVLayout(small_shape(), 4)) as pool:
        with pytest.raises(LayerIndexError, match="valid layers are 0..2"):
            pool.k_cache(3)
        with pytest.raises(TypeError, match="only int8"):
            pool.k_scale(0)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_block_payload_is_the_same_in_both_layouts(dtype):
    """read_block orders bytes (layer, k|v) then scales in either layout, so tiers and
    peers can exchange blocks between pools of different physical order."""
    shape = small_shape(dtype)
    with KVPool.create(KVLayout(shape, 4, LayoutKind.BLOCK_MAJOR)) as src, \
            KVPool.create(KVLayout(shape, 3, LayoutKind.PER_LAYER)) as dst:
        src.buffer.random_(0, 256)
        dst.write_block(2, src.read_block(1))
        for layer in range(3):
            for src_view, dst_view in ((src.k_cache(layer), dst.k_cache(layer)),
                                       (src.v_cache(layer), dst.v_cache(layer))):
                assert view_bytes(src_view[1]) == view_bytes(dst_view[2])
            if dtype == "int8":
                assert view_bytes(src.v_scale(layer)[1]) == view_bytes(dst.v_scale(layer)[2])
