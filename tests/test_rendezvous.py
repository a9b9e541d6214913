"""Rendezvous semantics: either side may come first, each key is used once, and nothing a
receiver waits on can leave it hanging (timeout, abort, cleanup).

Blocked receivers are observed through ``num_waiting()``, never through sleeps."""

import random
import threading
import time

import numpy as np
import pytest

from flowmill.kernels import DEAD
from flowmill.runtime.rendezvous import (
    DuplicateKeyError,
    Rendezvous,
    RendezvousKey,
    StepCancelledError,
    make_key,
    parse_key,
)

PS = "/job:ps/task:0/device:CPU:0"
WORKER = "/job:worker/task:0/device:CPU:0"
JOIN_TIMEOUT = 30.0


def key(name: str, step: int = 1) -> str:
    return make_key(WORKER, PS, name, step)


class Receiver(threading.Thread):
    """Calls ``rdv.recv`` in a daemon thread and keeps the value or the exception."""

    def __init__(self, rdv, k, timeout=None):
        super().__init__(daemon=True)
        self.rdv, self.k, self.timeout = rdv, k, timeout
        self.value = self.error = None

    def run(self):
        try:
            self.value = self.rdv.recv(self.k, timeout=self.timeout)
        except BaseException as e:  # inspected by the test
            self.error = e

    def finish(self):
        self.join(JOIN_TIMEOUT)
        assert not self.is_alive(), f"receiver of {self.k!r} still blocked"
        return self


def wait_for_waiters(rdv, n):
    deadline = time.monotonic() + JOIN_TIMEOUT
    while rdv.num_waiting() != n:
        assert time.monotonic() < deadline, f"{rdv.num_waiting()} waiters, expected {n}"
        time.sleep(0.001)


def test_key_round_trip():
    k = make_key(WORKER, PS, "w/read:0", 42)
    assert k == f"{WORKER};{PS};w/read:0;42"
    assert parse_key(k) == RendezvousKey(WORKER, PS, "w/read:0", 42)


@pytest.mark.parametrize(
    "bad, words",
    [
        ("garbage", "1 fields"),
        (f"{WORKER};{PS};x;1;2", "5 fields"),
        (f"{WORKER};{PS};x;step", "step id 'step'"),
        (f"{WORKER};{PS};x;-3", "step id '-3'"),
        (f"worker;{PS};x;1", "src_device 'worker'"),
        (f"{WORKER};;x;1", "dst_device ''"),
        (f"{WORKER};{PS};;1", "empty tensor name"),
    ],
)
def test_parse_key_names_the_problem(bad, words):
    with pytest.raises(ValueError, match="rendezvous key") as info:
        parse_key(bad)
    assert words in str(info.value)


def test_make_key_refuses_separator_in_parts():
    with pytest.raises(ValueError, match="fields"):
        make_key(WORKER, PS, "a;b", 1)


def test_send_then_recv():
    rdv = Rendezvous()
    value = np.arange(4)
    rdv.send(key("a"), value)
    assert len(rdv) == 1
    assert rdv.recv(key("a")) is value  # the same object: no copy inside a task
    assert len(rdv) == 0


def test_recv_then_send():
    rdv = Rendezvous()
    r = Receiver(rdv, key("a"))
    r.start()
    wait_for_waiters(rdv, 1)
    rdv.send(key("a"), np.ones(3))
    r.finish()
    assert r.error is None and np.array_equal(r.value, np.ones(3))
    assert rdv.num_waiting() == 0


def test_dead_passes_through():
    rdv = Rendezvous()
    rdv.send(key("d"), DEAD)
    assert rdv.recv(key("d")) is DEAD


def test_recv_timeout_names_the_key_and_frees_it():
    rdv = Rendezvous()
    with pytest.raises(TimeoutError, match="w/read:0"):
        rdv.recv(key("w/read:0"), timeout=0.05)
    assert rdv.num_waiting() == 0
    rdv.send(key("w/read:0"), 7)  # the key was not used up by the timed-out receiver
    assert rdv.recv(key("w/read:0"), timeout=1) == 7


def test_duplicate_send_names_the_key():
    rdv = Rendezvous()
    rdv.send(key("x"), 1)
    with pytest.raises(DuplicateKeyError, match="x;1' was sent twice"):
        rdv.send(key("x"), 2)
    assert rdv.recv(key("x")) == 1
    with pytest.raises(DuplicateKeyError, match="sent twice"):  # also after it was consumed
        rdv.send(key("x"), 3)


def test_second_receiver_is_an_error():
    rdv = Rendezvous()
    r = Receiver(rdv, key("x"))
    r.start()
    wait_for_waiters(rdv, 1)
    with pytest.raises(DuplicateKeyError, match="received twice"):
        rdv.recv(key("x"), timeout=1)
    rdv.send(key("x"), 5)
    assert r.finish().value == 5
    with pytest.raises(DuplicateKeyError, match="received twice"):
        rdv.recv(key("x"))


def test_abort_wakes_every_waiter_and_fails_later_calls():
    rdv = Rendezvous()
    receivers = [Receiver(rdv, key(f"t{i}", step=i % 3)) for i in range(6)]
    for r in receivers:
        r.start()
    wait_for_waiters(rdv, 6)
    error = ConnectionError("peer /job:ps/task:0 died")
    rdv.abort(error)
    for r in receivers:
        assert r.finish().error is error
    assert rdv.aborted is error
    with pytest.raises(ConnectionError, match="died"):
        rdv.send(key("late"), 1)
    with pytest.raises(ConnectionError, match="died"):
        rdv.recv(key("late2"), timeout=1)
    rdv.abort(RuntimeError("second"))  # the first error stays
    assert rdv.aborted is error


def test_cleanup_drops_leftovers_and_cancels_waiters():
    rdv = Rendezvous()
    rdv.send(key("left", step=5), np.zeros(2))
    rdv.send(key("kept", step=6), np.ones(2))
    rdv.send(key("used", step=5), 1)
    rdv.recv(key("used", step=5))
    r = Receiver(rdv, key("waiting", step=5))
    r.start()
    wait_for_waiters(rdv, 1)
    assert rdv.cleanup(5) == 3  # the leftover value, the tombstone, the waiter
    assert isinstance(r.finish().error, StepCancelledError)
    assert "step 5" in str(r.error)
    with pytest.raises(StepCancelledError, match="already cleaned up"):
        rdv.send(key("left", step=5), 1)
    with pytest.raises(StepCancelledError):
        rdv.recv(key("other", step=5), timeout=1)
    assert np.array_equal(rdv.recv(key("kept", step=6)), np.ones(2))
    assert len(rdv) == 0 and rdv.cleanup(6) == 1


def test_cancel_recv():
    rdv = Rendezvous()
    pending = rdv.start_recv(key("c"))
    assert not pending.done and not pending.wait(0.01)
    assert rdv.cancel_recv(pending, KeyError("stop"))
    assert pending.wait(0) and pending.done
    with pytest.raises(KeyError, match="stop"):
        pending.result()
    pending = rdv.start_recv(key("c"))  # the key is free again
    rdv.send(key("c"), 3)
    assert not rdv.cancel_recv(pending)  # too late: it has its value
    assert pending.wait(1) and pending.result() == 3


def test_keys_must_carry_a_step():
    with pytest.raises(ValueError, match="no step id"):
        Rendezvous().send("nostep", 1)


def test_many_threads_random_order():
    rdv = Rendezvous()
    n_steps, n_keys = 4, 50
    keys = [(s, k) for s in range(n_steps) for k in range(n_keys)]
    results, errors = {}, []

    def receive(items):
        try:
            for s, k in items:
                results[(s, k)] = rdv.recv(key(f"k{k}", s), timeout=JOIN_TIMEOUT)
        except BaseException as e:
            errors.append(e)

    def send(items):
        try:
            for s, k in items:
                rdv.send(key(f"k{k}", s), s * 1000 + k)
        except BaseException as e:
            errors.append(e)

    rng = random.Random(0)
    threads = []
    for fn in (receive, send):
        order = keys[:]
        rng.shuffle(order)
        threads += [threading.Thread(target=fn, args=(order[i::4],)) for i in range(4)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not errors
    assert results == {(s, k): s * 1000 + k for s, k in keys}
    assert len(rdv) == 0 and rdv.num_waiting() == 0
