"""A process's sockets read from the kernel's tables: listening ports, torchft's [::] servers
told from IPv4 ones, and the pid an established connection reaches."""

from __future__ import annotations

import os
import socket

from ddpguide.failures import sockets


def test_a_listening_port_is_seen_in_the_process_tables_and_a_closed_one_is_not():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert sockets.listening(os.getpid(), port)
        with socket.socket() as bound:           # bound, not listening: not taken for it
            bound.bind(("127.0.0.1", 0))
            assert not sockets.listening(os.getpid(), bound.getsockname()[1])
    assert not sockets.listening(os.getpid(), port)
    assert not sockets.listening(2 ** 22 + 1, port)   # no such process


def test_a_server_at_any_address_is_told_from_an_ipv4_one_and_a_connection_to_it_is_seen():
    me = os.getpid()
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as any_address, \
            socket.create_server(("127.0.0.1", 0)) as ipv4:
        v6, v4 = any_address.getsockname()[1], ipv4.getsockname()[1]
        assert v6 in sockets.servers(me) and v4 not in sockets.servers(me)
        assert sockets.connected_to(me, {v6: 1234}) is None     # nothing connected yet
        with socket.create_connection(("127.0.0.1", v6)) as client:
            accepted, _ = any_address.accept()
            with accepted:
                assert sockets.connected_to(me, {v6: 1234, v4: 99}) == 1234
                assert sockets.connected_to(me, {v4: 99}) is None
                assert client.getsockname()[1] not in sockets.servers(me)
    assert sockets.servers(2 ** 22 + 1) == set()
