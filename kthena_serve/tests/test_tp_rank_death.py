"""A TP rank whose process dies on start is reported at once, with its exit code and the cause.

The common case: a script that builds ``LLM(tp=2)`` at top level, without the
``if __name__ == "__main__":`` guard. Each spawned rank imports that script first, tries to
start the engine again, and multiprocessing stops it. Rank 0 used to wait the whole rendezvous
deadline (60 s) and then blame WORLD_SIZE.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from kthena_serve.engine.errors import RankDiedError
from kthena_serve.engine.parallel_runner import _check_workers

_NO_GUARD = """
from kthena_serve.llm import LLM

llm = LLM(tp=2, kv_cache_memory="32MiB", dtype="float32")
print("engine started")
"""


def test_a_dead_worker_is_reported_with_rank_and_exit_code():
    alive = mp.get_context("fork").Process(target=time.sleep, args=(30,), name="kthena-tp1")
    dead = mp.get_context("fork").Process(target=os._exit, args=(3,), name="kthena-tp2")
    alive.start()
    dead.start()
    try:
        dead.join(timeout=10)
        with pytest.raises(RankDiedError, match=r"rank 2 \(process kthena-tp2, pid \d+\) exited with code 3") as info:
            _check_workers([alive, dead])
        assert (info.value.rank, info.value.exitcode) == (2, 3)
        dead_only = [alive]
        _check_workers(dead_only)  # a live worker is no error
    finally:
        alive.kill()
        alive.join(timeout=10)


@pytest.mark.slow
def test_script_without_main_guard_fails_at_once_naming_the_guard(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_GUARD)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert out.returncode != 0 and "engine started" not in out.stdout
    err = out.stderr
    assert "RankDiedError: parallel rank 1" in err and "exited with code 1" in err, err[-3000:]
    assert 'Put that code under `if __name__ == "__main__":`' in err
    assert "finished its bootstrapping phase" in err  # the rank's own error, on stderr too
    assert "ranks joined" not in err  # not the rendezvous timeout that blamed WORLD_SIZE
    # Not a speed check: the old failure could only come at the 60 s rendezvous deadline.
    assert elapsed < 50, elapsed
