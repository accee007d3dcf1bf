"""When blocks that a failed KV hand-off may still write can be handed out again.

A one-sided transfer over TCP that its engine reported failed is not over: what it had put in
its sockets stays in the kernels, and once a partitioned link heals TCP delivers it and the
decode worker's transfer engine writes it into the blocks (kthena_comm's `tcp_queues`). A
block is reused only after both kernels say nothing of the failed transfer is left:

    prefill side   its puts have all ended and its sockets to the decode host hold no byte
                   the decode host has not acknowledged, on two looks `QUIET_S` apart
                   (`PushSession.settled` for a push; /pd/kv/backlog for a get it served)
    decode side    its own sockets from the prefill host hold no unread byte (what is read
                   is written: the transfer engine reads into the destination)

If the prefill worker is gone (its port refuses), its kernel may still send what its sockets
held: the decode side then waits until every socket from that host that was open when the
hand-off failed has received the peer's FIN (TCP sends it after the data) and nothing is left
unread. Neither side has a timer that ends the wait: a link that never heals keeps the blocks
aside (``num_quarantined`` in the decode worker's /pd/state counts them). Off Linux the
kernels cannot be read, and the prefill worker's word alone decides.
"""

from __future__ import annotations

from kthena_comm.transfer.tcp_queues import host_addresses, listening_ports, tcp_sockets

__all__ = ["LateWrites"]


class LateWrites:
    """The decode side's view of what a failed hand-off from ``host`` may still deliver.

    Made when the hand-off fails: it notes which sockets from that host were open then.
    """

    def __init__(self, host: str, *, own_reads_except_port: int | None = None) -> None:
        try:
            self._peers = host_addresses(host)
        except ValueError:
            self._peers = frozenset()  # unresolvable: no socket of ours can match it
        sockets = tcp_sockets(self._peers)
        self._open = {s.inode for s in sockets or () if s.peer_may_send}
        self._reads_except = own_reads_except_port

    def drained(self, peer_settled: bool) -> bool:
        """Whether nothing more can land: ``peer_settled`` says the prefill worker answered
        that nothing of the hand-off is left on its side (False: it is gone). For a get this
        process's transfer engine ran (``own_reads_except_port``: the prefill worker's HTTP
        port), its own connections to the prefill host other than to that port must be
        closed too: Mooncake holds one open per slice still reading."""
        sockets = tcp_sockets(self._peers)
        if sockets is None:
            return peer_settled
        if any(s.unread for s in sockets):
            return False
        if self._reads_except is not None:
            listening = listening_ports()
            if any(s.local_port not in listening and s.remote_port != self._reads_except
                   and s.peer_may_send for s in sockets):
                return False
        return peer_settled or not any(s.peer_may_send for s in sockets if s.inode in self._open)
