"""Mooncake's listening sockets, confined to one address.

Mooncake (0.3.x) has no setting for the address its client listens on. With the
``P2PHANDSHAKE`` metadata mode a store client or transfer engine opens two listeners:

    handshake RPC   findAvailableTcpPort(): bind(INADDR_ANY, random port in 15000-17000)
    TCP data        TcpContext: bind([::], port) dual stack, else bind(0.0.0.0, port)

``local_hostname`` and ``MC_TCP_BIND_ADDRESS`` only set the address it *advertises*; the
sockets listen on every interface, and they serve the memory the client registered (a store
client's segment holds every tenant's KV blocks).

``confine_listeners(host)`` fixes that at the binding boundary. Mooncake's shared objects call
libc's ``bind`` through their global offset table; for the duration of the ``with`` block the
``bind`` slots of the loaded Mooncake objects (``store.so``, ``engine.so``, ``libasio.so``)
point at a function that rewrites a wildcard address to ``host`` (an IPv6 wildcard to
``::ffff:host``, which a dual-stack socket serves for IPv4 peers) and calls libc's ``bind``.
Binds to a named address, and binds outside the block, go to libc unchanged. On leaving the
block it checks ``/proc/net/tcp*``: a new wildcard listener of this process raises
``ListenConfinementError``, so a Mooncake that binds some other way is refused, not trusted.

    with confine_listeners("127.0.0.1"):
        client.setup("127.0.0.1", "P2PHANDSHAKE", ...)   # listens on 127.0.0.1 only

Linux only (ELF objects, ``/proc``); elsewhere ``confine_listeners`` raises
``ListenConfinementError``. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import ipaddress
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ListenConfinementError", "confine_listeners", "listening_sockets",
           "wildcard_listeners"]


class ListenConfinementError(RuntimeError):
    """Mooncake's listeners cannot be kept to the address asked for (the message says why)."""


# ---- listening sockets of a process (what `ss -ltnp` shows) -----------------------------------

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    # /proc/net/tcp6 prints the address as four host-order 32-bit words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening_sockets(pid: int | None = None) -> list[tuple[str, int]]:
    """The TCP sockets process ``pid`` (default: this one) listens on, as (address, port).

    Read from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (the LISTEN rows whose inode is one of
    the process's descriptors), so it needs no ``ss``. An IPv6 address is printed as such
    (``::``, ``::1``, ``::ffff:127.0.0.1``).
    """
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            # the namespace of the process: another network namespace has other tables
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            for row in rows:
                fields = row.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    found.append(_address(fields[1]))
    return sorted(found)


def wildcard_listeners(pid: int | None = None) -> list[tuple[str, int]]:
    """The listeners of ``pid`` (default: this process) on every interface (0.0.0.0 or ::)."""
    return [(host, port) for host, port in listening_sockets(pid) if host in ("0.0.0.0", "::")]


# ---- the bind redirection ---------------------------------------------------------------------

# relocation types that fill a GOT slot with a symbol's address, per ELF machine
_SLOT_RELOCATIONS = {62: (6, 7), 183: (1025, 1026)}  # x86-64: GLOB_DAT, JUMP_SLOT; aarch64
_SHT_RELA, _SHT_DYNSYM = 4, 11


def _bind_slots(path: str) -> tuple[list[int], int]:
    """(offsets of the GOT slots bound to libc's ``bind``, p_vaddr of the first PT_LOAD)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ListenConfinementError(f"{path} is not a 64-bit little-endian ELF object")
    machine, = struct.unpack_from("<H", data, 18)
    if machine not in _SLOT_RELOCATIONS:
        raise ListenConfinementError(f"{path}: ELF machine {machine} is not x86-64 or aarch64")
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    loads = [struct.unpack_from("<IIQQ", data, phoff + i * phentsize) for i in range(phnum)]
    first_load = min(vaddr for kind, _, _, vaddr in loads if kind == 1)  # PT_LOAD
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    slots = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_RELA or sections[link][1] != _SHT_DYNSYM:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for at in range(offset, offset + size, entsize or 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, at)
            if r_info & 0xFFFFFFFF not in _SLOT_RELOCATIONS[machine]:
                continue
            name_at, = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * symtab[9])
            start = strtab[4] + name_at
            if data[start:data.index(b"\0", start)] == b"bind":
                slots.append(r_offset)
    return slots, first_load


def _mappings() -> list[tuple[int, int, str, int, str]]:
    """(start, end, permissions, file offset, path) of this process's mappings."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[1], int(fields[2], 16), fields[5]))
    return found


def _mooncake_objects(maps: list[tuple[int, int, str, int, str]]) -> dict[str, int]:
    """Loaded shared objects of the Mooncake wheel -> the address of their file offset 0."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ListenConfinementError("the Mooncake wheel is not installed")
    package = Path(next(iter(spec.submodule_search_locations))).resolve()

    def is_mooncake(path: Path) -> bool:  # mooncake/*.so, mooncake*.libs/*.so
        folder = path.parent
        return folder == package or (folder.parent == package.parent
                                     and folder.name.startswith("mooncake")
                                     and folder.name.endswith(".libs"))

    return {path: start for start, _, _, offset, path in maps
            if offset == 0 and ".so" in path and is_mooncake(Path(path))}


_libc = ctypes.CDLL(None)
_libc_bind = _libc.bind
_libc_bind.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
_libc_bind.restype = ctypes.c_int
_errno_location = _libc.__errno_location
_errno_location.restype = ctypes.POINTER(ctypes.c_int)
_mprotect = _libc.mprotect
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)
_lock = threading.Lock()
_target: bytes | None = None  # the IPv4 address wildcard binds go to, inside the block
_WILDCARD4, _WILDCARD6 = bytes(4), bytes(16)


def _redirected(addr: int, length: int) -> ctypes.Array | None:
    """A copy of the sockaddr at ``addr`` with its wildcard address replaced, or None."""
    target = _target
    if target is None or not addr:
        return None
    family = ctypes.c_ushort.from_address(addr).value
    if family == socket.AF_INET and length >= 8 and ctypes.string_at(addr + 4, 4) == _WILDCARD4:
        at, value = 4, target
    elif (family == socket.AF_INET6 and length >= 24
          and ctypes.string_at(addr + 8, 16) == _WILDCARD6):
        at, value = 8, bytes(10) + b"\xff\xff" + target  # ::ffff:a.b.c.d
    else:
        return None
    copy = ctypes.create_string_buffer(ctypes.string_at(addr, length), length)
    ctypes.memmove(ctypes.addressof(copy) + at, value, len(value))
    return copy


def _bind(fd: int, addr: int, length: int) -> int:
    try:
        copy = _redirected(addr, length)
        result = _libc_bind(fd, ctypes.addressof(copy) if copy is not None else addr, length)
        error = _errno_location()[0]
    except BaseException:  # noqa: BLE001 - never return "bound" for a socket that is not
        result, error = -1, errno.EINVAL
    _errno_location()[0] = error  # what the caller reads (asio makes its error_code from it)
    return result


_bind_function = _BIND(_bind)
_BIND_ADDRESS = ctypes.cast(_bind_function, ctypes.c_void_p).value
_patched: set[str] = set()


def _write_slot(slot: int, maps: list[tuple[int, int, str, int, str]]) -> None:
    page = slot & ~(mmap.PAGESIZE - 1)
    perms = next((p for start, end, p, _, _ in maps if start <= slot < end), "")
    if not perms.startswith("r"):
        raise ListenConfinementError(f"GOT slot {slot:#x} is not mapped")
    if "w" not in perms and _mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE):
        raise ListenConfinementError(f"cannot make GOT slot {slot:#x} writable")
    ctypes.c_void_p.from_address(slot).value = _BIND_ADDRESS
    if "w" not in perms:  # RELRO: read-only again
        _mprotect(page, mmap.PAGESIZE, mmap.PROT_READ)


def _install() -> None:
    """Point the ``bind`` slots of every loaded Mooncake object at ``_bind`` (once each)."""
    maps = _mappings()
    objects = _mooncake_objects(maps)
    if not objects:
        raise ListenConfinementError("no Mooncake shared object is loaded: import "
                                     "mooncake.store / mooncake.engine first")
    for path, start in objects.items():
        if path in _patched:
            continue
        slots, first_load = _bind_slots(path)
        bias = start - (first_load & ~(mmap.PAGESIZE - 1))
        for slot in slots:
            _write_slot(bias + slot, maps)
        _patched.add(path)


def _ipv4(host: str) -> bytes:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
        except OSError as error:
            raise ListenConfinementError(f"{host!r} does not resolve to an IPv4 address "
                                         f"({error})") from None
    if address.version != 4:
        raise ListenConfinementError(f"Mooncake's listeners can be kept to an IPv4 address, "
                                     f"not {host!r}")
    return address.packed


@contextlib.contextmanager
def confine_listeners(host: str = "127.0.0.1") -> Iterator[None]:
    """Inside the block, the loaded Mooncake objects listen on ``host`` instead of every
    interface (see the module docs). Import the Mooncake module first; blocks run one at a
    time (a lock).

    Raises:
        ListenConfinementError: ``host`` is not an IPv4 address (or a name of one), the
            objects cannot be patched, or a wildcard listener of this process appeared in
            the block anyway (the caller should close what it opened and give up).
    """
    target = _ipv4(host)
    if not Path("/proc/self/maps").exists():
        raise ListenConfinementError("confining Mooncake's listeners needs Linux (/proc)")
    global _target
    with _lock:
        _install()
        before = set(wildcard_listeners())
        _target = target
        try:
            yield
        finally:
            _target = None
        opened = sorted(set(wildcard_listeners()) - before)
        if opened:
            raise ListenConfinementError(
                f"Mooncake opened listeners on every interface ({opened}) although they were "
                f"to be kept to {host}")
