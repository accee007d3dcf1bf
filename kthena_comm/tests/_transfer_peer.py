"""A transfer peer in its own process, driven by JSON lines on stdin (run by path, not imported).

Usage: python _transfer_peer.py BACKEND NBYTES SEED SHM_PREFIX [TORCH_MASTER_PORT]

Registers NBYTES of memory filled with seeded random bytes, prints its handle and engine address
as one JSON line, then answers commands: {"cmd": "read", "offset": o, "length": n} ->
{"data": hex}, {"cmd": "unregister"} -> {"ok": true}, {"cmd": "notifies", "timeout_s": t} ->
{"messages": [[sender, hex], ...]}, {"cmd": "notify", "peer": address, "data": hex} ->
{"ok": true} or {"error": text}, {"cmd": "exit"} -> closes the engine and exits. For ``torch`` the peer is rank 1
of a two-rank transfer world whose rank 0 (the test process) hosts the store.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import mmap  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

from kthena_comm.transfer import ShmConfig, TorchConfig, create_engine  # noqa: E402


def make_memory(backend: str, nbytes: int, prefix: str, port: int):
    if backend == "torch":
        engine = create_engine("torch", TorchConfig(rank=1, world_size=2, master_port=port,
                                                    connect_timeout_s=60))
        memory = mmap.mmap(-1, nbytes)
        return engine, engine.register(memory), memoryview(memory)
    if backend == "shm":
        engine = create_engine("shm", ShmConfig(prefix=prefix))
        handle = engine.allocate(nbytes)
        return engine, handle, engine.buffer(handle)
    engine = create_engine(backend)
    memory = mmap.mmap(-1, nbytes)
    return engine, engine.register(memory), memoryview(memory)


def main() -> None:
    backend, nbytes, seed, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    port = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    engine, handle, view = make_memory(backend, nbytes, prefix, port)
    view[:] = random.Random(seed).randbytes(nbytes)
    print(json.dumps({"handle": handle.to_dict(), "address": engine.address, "pid": os.getpid()}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "read":
            data = bytes(view[cmd["offset"]: cmd["offset"] + cmd["length"]])
            print(json.dumps({"data": data.hex()}), flush=True)
        elif cmd["cmd"] == "notifies":
            got = engine.poll_notifies(cmd["timeout_s"])
            print(json.dumps({"messages": [[n.sender, n.message.hex()] for n in got]}), flush=True)
        elif cmd["cmd"] == "notify":
            try:
                engine.notify(cmd["peer"], bytes.fromhex(cmd["data"]))
                print(json.dumps({"ok": True}), flush=True)
            except Exception as exc:  # reported, not fatal: tests check the error
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        elif cmd["cmd"] == "unregister":
            engine.unregister(handle)
            print(json.dumps({"ok": True}), flush=True)
        else:
            break
    view.release()
    engine.close()


if __name__ == "__main__":
    main()
