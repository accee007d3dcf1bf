"""Unlinks a process's shared-memory segments when that process ends, however it ends.

Run by path with ``python -I -S`` (standard library only, no kthena_comm import). The owning
engine writes ``+name`` / ``-name`` lines to our stdin as it creates and removes segments; when
stdin reaches end of file — the owner closed the engine, exited, or was killed with SIGKILL —
every segment still listed is unlinked.
"""

import os
import sys


def main(directory: str) -> None:
    names: set[str] = set()
    for line in sys.stdin:
        name = line[1:].strip()
        if not name or "/" in name or name.startswith("."):
            continue
        if line.startswith("+"):
            names.add(name)
        elif line.startswith("-"):
            names.discard(name)
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    main(sys.argv[1])
