"""The operator's store of jobs and pods: watch events, its own writes laid over them, and
fresh reads, each kept in resourceVersion order."""

from __future__ import annotations

import json

from flowmill.operator.controller import job_of
from flowmill.operator.store import SHARED_STRING_MAX, TOMBSTONE_SECONDS, Store


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, rv: int, uid: str | None = None, phase: str = "Running",
        job: str = "mnist", **meta) -> dict:
    return {"metadata": {"name": name, "namespace": "ml", "uid": uid or f"uid-{name}",
                         "resourceVersion": str(rv), "labels": {"flowmill.dev/job-name": job},
                         "managedFields": [{"manager": "kubelet"}], **meta},
            "status": {"phase": phase}}


def job(rv: int, uid: str = "job-uid") -> dict:
    return {"metadata": {"name": "mnist", "namespace": "ml", "uid": uid,
                         "resourceVersion": str(rv)}, "spec": {}}


def listing(rv: int, *items: dict) -> dict:
    return {"metadata": {"resourceVersion": str(rv)}, "items": list(items)}


def names(pods: list[dict] | None) -> dict[str, str]:
    assert pods is not None
    return {p["metadata"]["name"]: p["status"]["phase"] for p in pods}


def test_pods_are_read_afresh_first_and_then_kept_by_the_watch():
    clock = Clock()
    store = Store(job_of, refill_after=300, clock=clock)
    store.put_pod(pod("mnist-worker-0", 5))  # events before the first reconcile are kept
    assert store.pods("ml", "mnist") is None  # but the job has not been read yet
    assert names(store.fill("ml", "mnist", listing(6, pod("mnist-worker-0", 5),
                                                   pod("mnist-ps-0", 4)))) == {
        "mnist-worker-0": "Running", "mnist-ps-0": "Running"}
    store.put_pod(pod("mnist-worker-0", 9, phase="Failed"))
    store.put_pod(pod("mnist-worker-0", 7, phase="Running"))  # late and older: ignored
    assert names(store.pods("ml", "mnist"))["mnist-worker-0"] == "Failed"
    assert all("managedFields" not in p["metadata"] for p in store.pods("ml", "mnist"))
    clock.now += 301
    assert store.pods("ml", "mnist") is None  # the periodic fresh read is due


def test_a_fresh_read_keeps_what_is_newer_than_it_and_drops_what_it_lacks():
    store = Store(job_of)
    store.fill("ml", "mnist", listing(10, pod("mnist-ps-0", 8), pod("mnist-worker-0", 9)))
    store.put_pod(pod("mnist-worker-1", 12))  # made after the next list was taken
    store.put_pod(pod("mnist-ps-0", 13, phase="Failed"))  # changed after it, too
    fresh = store.fill("ml", "mnist", listing(11, pod("mnist-ps-0", 8)))
    # worker-0 went before the list (a deletion the watch missed); worker-1 came after it
    assert names(fresh) == {"mnist-ps-0": "Failed", "mnist-worker-1": "Running"}


def test_a_deleted_pod_stays_gone_whatever_arrives_late():
    clock = Clock()
    store = Store(job_of, clock=clock)
    store.fill("ml", "mnist", listing(10, pod("mnist-worker-0", 9, phase="Failed")))
    store.drop_pod(pod("mnist-worker-0", 11))  # deleted at once, by this operator
    store.put_pod(pod("mnist-worker-0", 9, phase="Failed"))  # an event from before
    assert names(store.pods("ml", "mnist")) == {}
    # nor does a list taken before the deletion bring it back
    assert names(store.fill("ml", "mnist", listing(10, pod("mnist-worker-0", 9)))) == {}
    # its replacement has the same name and another uid
    store.put_pod(pod("mnist-worker-0", 12, uid="uid-new"))
    assert names(store.pods("ml", "mnist")) == {"mnist-worker-0": "Running"}
    clock.now += TOMBSTONE_SECONDS + 1
    store.drop_pod(pod("other", 20))  # tombstones are let go after a while
    assert "uid-mnist-worker-0" not in store._tombstones


def test_a_write_response_wins_over_the_older_watch_copy():
    store = Store(job_of)
    store.fill("ml", "mnist", listing(10, pod("mnist-worker-0", 9, phase="Failed")))
    terminating = pod("mnist-worker-0", 15, phase="Failed",
                      deletionTimestamp="2025-01-01T00:00:00Z", deletionGracePeriodSeconds=30)
    store.put_pod(terminating)
    store.put_pod(pod("mnist-worker-0", 14, phase="Failed"))  # the watch, behind
    (held,) = store.pods("ml", "mnist")
    assert held["metadata"]["deletionTimestamp"]


def test_jobs_keep_the_newest_copy_and_a_new_job_of_the_same_name_replaces_the_old():
    store = Store(job_of)
    store.put_job(job(5))
    store.put_job(job(4))
    assert store.job("ml", "mnist")["metadata"]["resourceVersion"] == "5"
    store.put_job(job(2, uid="job-uid-2"))  # deleted and made again: another object
    assert store.job("ml", "mnist")["metadata"]["uid"] == "job-uid-2"
    store.drop_job(job(6))  # the old one's DELETED event, late: the new one stays
    assert store.job("ml", "mnist")["metadata"]["uid"] == "job-uid-2"
    store.drop_job(job(3, uid="job-uid-2"))
    assert store.job("ml", "mnist") is None


def test_unfill_and_forget():
    store = Store(job_of)
    store.put_job(job(5))
    store.fill("ml", "mnist", listing(10, pod("mnist-worker-0", 9)))
    store.unfill("ml", "mnist")
    assert store.pods("ml", "mnist") is None and store.job("ml", "mnist") is not None
    store.forget("ml", "mnist")
    assert store.job("ml", "mnist") is None and store.sizes() == (0, 0)
    store.put_pod(pod("stray", 3, job=""))  # no job: not kept
    assert store.sizes() == (0, 0)


def test_one_read_of_a_namespace_fills_every_job_in_it():
    clock = Clock()
    store = Store(job_of, refill_after=300, clock=clock)
    store.put_pod(pod("gone-worker-0", 3, job="gone"))  # deleted while nobody watched
    assert store.namespace_due("ml") and store.pods("ml", "mnist") is None
    store.fill_namespace("ml", listing(10, pod("mnist-worker-0", 9),
                                       pod("other-worker-0", 8, job="other")))
    assert names(store.pods("ml", "mnist")) == {"mnist-worker-0": "Running"}
    assert names(store.pods("ml", "other")) == {"other-worker-0": "Running"}
    assert names(store.pods("ml", "gone")) == {}  # and a job with no pod has none
    assert store.pods("elsewhere", "mnist") is None  # another namespace is read on its own
    store.unfill("ml", "mnist")  # a write found the store behind: this job alone again
    assert store.stale("ml", "mnist") and store.pods("ml", "mnist") is None
    assert store.pods("ml", "other") is not None
    store.fill("ml", "mnist", listing(12, pod("mnist-worker-0", 11, phase="Failed")))
    assert not store.stale("ml", "mnist")
    assert names(store.pods("ml", "mnist")) == {"mnist-worker-0": "Failed"}
    clock.now += 301
    assert store.namespace_due("ml") and store.pods("ml", "other") is None


def test_news_is_what_the_store_did_not_hold_already():
    store = Store(job_of)
    assert store.put_job(job(5)) is True
    assert store.put_job(job(5)) is False  # the watch's echo of a write's response
    assert store.put_job(job(4)) is False and store.put_job(job(6)) is True
    assert store.put_pod(pod("mnist-worker-0", 7)) is True
    assert store.put_pod(pod("mnist-worker-0", 7)) is False
    assert store.put_pod(pod("mnist-worker-0", 8, phase="Failed")) is True
    assert store.drop_pod(pod("mnist-worker-0", 9)) is True  # deleted by someone else
    store.put_pod(pod("mnist-worker-1", 10))
    store.drop_pod(pod("mnist-worker-1", 11))  # this operator's deletion, at once
    assert store.drop_pod(pod("mnist-worker-1", 11)) is False  # its DELETED event
    assert store.drop_job(job(12)) is True and store.drop_job(job(12)) is False



def test_the_store_keeps_compact_copies_that_share_keys_and_short_strings():
    def parsed(name: str) -> dict:  # each watch event is parsed on its own
        obj = pod(name, 5)
        obj["status"]["message"] = "m" * (SHARED_STRING_MAX + 1)
        return json.loads(json.dumps(obj))

    store = Store(job_of)
    store.fill("ml", "mnist", listing(1))
    a, b = parsed("mnist-worker-0"), parsed("mnist-worker-1")
    store.put_pod(a), store.put_pod(b)
    kept = {p["metadata"]["name"]: p for p in store.pods("ml", "mnist") or ()}
    ka, kb = kept["mnist-worker-0"], kept["mnist-worker-1"]
    assert "managedFields" not in ka["metadata"] and "managedFields" in a["metadata"]
    del a["metadata"]["managedFields"]
    assert ka == a  # the same content otherwise
    key_a, key_b = (next(k for k in p["status"] if k == "phase") for p in (ka, kb))
    assert key_a is key_b  # one copy of each key ...
    assert ka["status"]["phase"] is kb["status"]["phase"]  # ... and of each short string
    assert ka["status"]["message"] is not kb["status"]["message"]  # long ones are not shared
