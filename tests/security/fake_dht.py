"""An in-memory stand-in for hivemind.DHT's read and write calls, holding what an attacker stored."""

from __future__ import annotations

import concurrent.futures
import time


class Item:
    def __init__(self, value, expiration_time: float):
        self.value, self.expiration_time = value, expiration_time


class FakeDHT:
    def __init__(self):
        self.stored: dict[str, object] = {}

    def store(self, key, value, expiration_time=None, subkey=None, return_future=False):
        expiration_time = time.time() + 60 if expiration_time is None else expiration_time
        if subkey is None:
            self.stored[key] = Item(value, expiration_time)
        else:
            entries = self.stored.setdefault(key, Item({}, expiration_time))
            entries.value[subkey] = Item(value, expiration_time)
            entries.expiration_time = max(entries.expiration_time, expiration_time)
        if not return_future:
            return True
        future = concurrent.futures.Future()
        future.set_result(True)
        return future

    def get(self, key, latest=True, return_future=False):
        future = concurrent.futures.Future()
        future.set_result(self.stored.get(key))
        return future if return_future else future.result()
