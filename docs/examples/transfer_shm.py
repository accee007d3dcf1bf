"""Two processes, one shared-memory KV pool: a one-sided put with kthena_comm's ``shm`` backend.

    python docs/examples/transfer_shm.py

The "decode" process (this one) allocates a pool of blocks and hands its ``MemoryHandle`` (a
small JSON value) to a "prefill" process it starts. The prefill process registers its own
memory, puts three of its blocks into three blocks of the pool in one batch and notifies the
decode process, which checks that exactly those bytes arrived and nothing else changed. Both
engines are closed, and the script checks that no shared-memory file is left in /dev/shm.
"""

import glob
import os
import subprocess
import sys

import numpy as np

from kthena_comm.transfer import MemoryHandle, ShmConfig, TransferBatch, create_engine

NUM_BLOCKS, BLOCK_BYTES = 16, 64 * 1024
SRC_BLOCK_IDS, DST_BLOCK_IDS = [0, 1, 5], [7, 8, 2]  # prefill block i lands in decode block j
PREFIX = f"kthena-example-{os.getpid()}"  # our own segment names, to check for leftovers


def prefill_blocks() -> np.ndarray:
    """What the prefill worker computed: NUM_BLOCKS blocks of seeded random bytes."""
    return np.random.default_rng(0).integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8)


def prefill(handle_json: str, prefix: str) -> None:
    """The prefill process: put blocks into the decode pool, then say so."""
    remote = MemoryHandle.from_json(handle_json)
    kv = prefill_blocks()
    with create_engine("shm", ShmConfig(prefix=prefix)) as engine:
        local = engine.register(kv)  # any contiguous CPU buffer: numpy, torch, mmap
        batch = TransferBatch.from_blocks(local, remote, SRC_BLOCK_IDS, DST_BLOCK_IDS,
                                          BLOCK_BYTES)
        engine.batch_put_async(batch).wait(timeout_s=10)  # submit, compute on, then wait
        engine.notify(remote, b"req-1: blocks 7 8 2 written")  # arrives after the bytes


def decode() -> None:
    """The decode process: own the pool, start the prefill process, check what arrived."""
    with create_engine("shm", ShmConfig(prefix=PREFIX)) as engine:
        pool = engine.allocate(NUM_BLOCKS * BLOCK_BYTES, layout_id="example-v1")
        child = subprocess.run([sys.executable, __file__, "prefill", pool.to_json(), PREFIX],
                               timeout=120)
        assert child.returncode == 0, f"the prefill process failed ({child.returncode})"
        notes = engine.poll_notifies(timeout_s=5)
        assert [n.message for n in notes] == [b"req-1: blocks 7 8 2 written"], notes
        view = engine.buffer(pool)
        got = np.frombuffer(view, dtype=np.uint8).reshape(NUM_BLOCKS, BLOCK_BYTES).copy()
        view.release()
    sent = prefill_blocks().reshape(NUM_BLOCKS, BLOCK_BYTES)
    assert (got[DST_BLOCK_IDS] == sent[SRC_BLOCK_IDS]).all(), "the blocks did not arrive"
    untouched = [b for b in range(NUM_BLOCKS) if b not in DST_BLOCK_IDS]
    assert not got[untouched].any(), "bytes outside the put changed"
    leftovers = glob.glob(f"/dev/shm/{PREFIX}*")
    assert not leftovers, f"shared memory left behind: {leftovers}"
    print(f"{len(DST_BLOCK_IDS)} blocks of {BLOCK_BYTES} bytes arrived from {notes[0].sender};"
          f" no shared memory left in /dev/shm")


if __name__ == "__main__":
    if sys.argv[1:2] == ["prefill"]:
        prefill(sys.argv[2], sys.argv[3])
    else:
        decode()
