"""Clients dropped without close() never disturb other clients: every call is accounted for."""

from __future__ import annotations

import gc
import threading

import numpy as np

from edge_server.client import Client
from tests.daemon import Daemon


def test_clients_collected_without_close_do_not_lose_other_clients_replies(daemon: Daemon) -> None:
    x = np.ones(16, np.float32)
    for _round in range(4):
        dropped = [Client(daemon.address, timeout=None) for _ in range(8)]
        for client in dropped:
            assert client.server_live()
        del dropped, client
        answered: list[int] = []

        def work(answered: list[int] = answered) -> None:
            client = Client(daemon.address, timeout=None)  # no timeout: a lost reply would hang here
            count = 0
            for _ in range(30):
                np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
                count += 1
            answered.append(count)  # and this one is dropped without close(), too

        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads), "a call never returned"
        assert answered == [30] * 8
        gc.collect()
