"""The jobs and pods as the watches last showed them, with the operator's own writes laid
over them until the watches catch up.

Why: a reconcile used to GET its job and LIST its pods, two requests every time any pod
of the job changed. The watches the operator holds anyway (kopf's, on TrainingJobs and on
pods labelled with a job) already deliver every change, so reconciles read this store
instead and the API server sees only writes.

A store read can be older than the API server in two ways, and each is closed here:

- **The operator's own writes** arrive on the watch after the write returns. Until then
  a reconcile could act on a pod it has already deleted (and count its failure again).
  So every write's response goes into the store at once (client-go's ``MutationCache``
  does the same), an immediate deletion leaves a tombstone, and a watch event older than
  what the store holds (by ``resourceVersion``) is ignored.
- **Anything it missed** (a watch that broke and was resumed without a replay of
  deletions, an operator that just started): a namespace's pods are read by one LIST
  (``fill_namespace``) the first time one of its jobs is reconciled and again when that
  read is older than ``refill_after``; a job's own pods (and the job) are read again when
  a write is refused as stale (409/404), which the reconcile asks for with ``unfill``.
  Between fills the watch keeps them current.

Writes to the job carry its ``resourceVersion`` as a precondition, so a decision taken
on a stale job is refused and taken again: the store can make a reconcile redo work, never
count a restart twice. Thread-safe: events arrive on the event loop, reconciles run in
worker threads.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, job name)

TOMBSTONE_SECONDS = 120.0


def newer_or_same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether object ``a`` is at least as new as ``b`` (same object): etcd revisions
    compare as integers; anything else is taken as newer."""
    try:
        return int(a["metadata"]["resourceVersion"]) >= int(b["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return True


def same_version(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two copies of an object are of one resourceVersion (one without any is
    taken as another)."""
    rv = (a.get("metadata") or {}).get("resourceVersion")
    return rv is not None and rv == (b.get("metadata") or {}).get("resourceVersion")


_intern = sys.intern


def compact(obj: Mapping[str, Any]) -> Obj:
    """The object as the store keeps it: without ``metadata.managedFields`` (often half
    its size; no decision reads it), rebuilt with its keys and short strings interned.

    Why rebuilt: every watch event is parsed on its own, so each object carries its own
    copies of the same keys ("metadata", "containerStatuses", ...) and values ("Running",
    "True", label values). Interned, a thousand jobs' objects share one copy of each, and
    the store holds about half the memory a shallow copy of the parsed event would; the
    parsed event is then garbage as a whole, not left in pieces under the stored copy."""
    return {_intern(k): _compact(v) for k, v in obj.items() if k != "metadata"} | {
        "metadata": {_intern(k): _compact(v) for k, v in (obj.get("metadata") or {}).items()
                     if k != "managedFields"}}


SHARED_STRING_MAX = 64  # longer strings (messages, certificates, JSON) are rarely repeated


def _compact(value: Any) -> Any:
    if isinstance(value, str):
        return _intern(value) if len(value) <= SHARED_STRING_MAX else value
    if isinstance(value, dict):
        return {_intern(k): _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


class Store:
    def __init__(self, job_of: Callable[[Mapping[str, Any]], str | None],
                 refill_after: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._job_of = job_of
        self.refill_after = refill_after
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[Key, Obj] = {}
        self._pods: dict[Key, dict[str, Obj]] = {}  # job -> uid -> pod
        self._filled: dict[Key, float] = {}  # job -> when its pods were last LISTed
        self._namespaces: dict[str, float] = {}  # namespace -> when all its pods were
        self._stale: set[Key] = set()  # jobs a write found the store behind on
        self._tombstones: dict[str, float] = {}  # uid of a pod known gone -> when

    # ---- jobs

    def job(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            return self._jobs.get((namespace, name))

    def put_job(self, obj: Mapping[str, Any]) -> bool:
        """A job from a watch event or a write's response; an older copy is ignored, and a
        job of the same name but another uid (deleted and made again) replaces it.
        Whether it is news: not a copy the store holds already (the watch's echo of this
        operator's own write is not)."""
        key = _key(obj, obj["metadata"].get("name"))
        with self._lock:
            have = self._jobs.get(key)
            if have is None or _uid(have) != _uid(obj) or newer_or_same(obj, have):
                self._jobs[key] = compact(obj)
                return have is None or _uid(have) != _uid(obj) or not same_version(obj, have)
            return False

    def drop_job(self, obj: Mapping[str, Any]) -> bool:
        """The job's DELETED event: gone, unless a newer job took the name meanwhile.
        Whether the store held it."""
        key = _key(obj, obj["metadata"].get("name"))
        with self._lock:
            have = self._jobs.get(key)
            if have is not None and _uid(have) == _uid(obj):
                del self._jobs[key]
                return True
            return False

    # ---- pods

    def pods(self, namespace: str, job: str) -> list[Obj] | None:
        """The job's pods, or None when they must be read afresh: the namespace's pods
        (``fill_namespace``) when no read of them is recent, else the job's (``fill``)
        after ``unfill``."""
        key = (namespace, job)
        with self._lock:
            if self._due(key):
                return None
            return list(self._pods.get(key, {}).values())

    def due(self, namespace: str, job: str) -> bool:
        """Whether the job's pods must be read afresh before they are used."""
        with self._lock:
            return self._due((namespace, job))

    def _due(self, key: Key) -> bool:
        if key in self._stale:
            return True
        filled = max(self._filled.get(key, -math.inf), self._namespaces.get(key[0], -math.inf))
        return self._clock() - filled > self.refill_after

    def stale(self, namespace: str, job: str) -> bool:
        """Whether a write found the store behind on the job (until its next ``fill``)."""
        with self._lock:
            return (namespace, job) in self._stale

    def namespace_due(self, namespace: str) -> bool:
        with self._lock:
            filled = self._namespaces.get(namespace, -math.inf)
            return self._clock() - filled > self.refill_after

    def fill(self, namespace: str, job: str, listing: Mapping[str, Any]) -> list[Obj]:
        """A fresh LIST of the job's pods (``items`` and the list's ``resourceVersion``)
        replaces what the store holds for it: a cached pod the list lacks stays only if
        it is newer than the list (made since); one the list has stays if it is newer
        still; a tombstoned pod stays gone."""
        key = (namespace, job)
        with self._lock:
            self._expire_tombstones()
            fresh = self._merge(key, listing.get("items") or (), _list_rv(listing))
            self._filled[key] = self._clock()
            self._stale.discard(key)
            return list(fresh.values())

    def fill_namespace(self, namespace: str, listing: Mapping[str, Any]) -> None:
        """A fresh LIST of every job's pods in the namespace: ``fill`` for each job it
        has pods of or the store holds pods of. One request brings a new process (or the
        periodic fresh read) the pods of all its jobs."""
        by_job: dict[Key, list[Mapping[str, Any]]] = {}
        for pod in listing.get("items") or ():
            job = self._job_of(pod["metadata"])
            if job:
                by_job.setdefault((namespace, job), []).append(pod)
        list_rv = _list_rv(listing)
        with self._lock:
            self._expire_tombstones()
            for key in by_job.keys() | {k for k in self._pods if k[0] == namespace}:
                self._merge(key, by_job.get(key, ()), list_rv)
                self._stale.discard(key)
            self._namespaces[namespace] = self._clock()

    def _merge(self, key: Key, items: Iterable[Mapping[str, Any]],
               list_rv: Mapping[str, Any]) -> dict[str, Obj]:
        have = self._pods.get(key, {})
        fresh: dict[str, Obj] = {}
        for pod in items:
            uid = _uid(pod)
            if uid in self._tombstones:
                continue
            old = have.get(uid)
            fresh[uid] = old if old is not None and newer_or_same(old, pod) else compact(pod)
        for uid, old in have.items():
            if uid not in fresh and uid not in self._tombstones \
                    and not newer_or_same(list_rv, old):
                fresh[uid] = old
        if fresh:
            self._pods[key] = fresh
        else:
            self._pods.pop(key, None)
        return fresh

    def put_pod(self, obj: Mapping[str, Any]) -> bool:
        """A pod from a watch event or a write's response (older copies are ignored).
        Whether it is news (see ``put_job``)."""
        job = self._job_of(obj["metadata"])
        if not job:
            return False
        uid = _uid(obj)
        key = _key(obj, job)
        with self._lock:
            if uid in self._tombstones:
                return False
            pods = self._pods.setdefault(key, {})
            have = pods.get(uid)
            if have is None or newer_or_same(obj, have):
                pods[uid] = compact(obj)
                return have is None or not same_version(obj, have)
            return False

    def drop_pod(self, obj: Mapping[str, Any]) -> bool:
        """The pod is gone (its DELETED event, or a deletion that took effect at once).
        Whether it is news: not when this operator's deletion took it already."""
        uid = _uid(obj)
        job = self._job_of(obj["metadata"])
        with self._lock:
            self._expire_tombstones()
            known = uid in self._tombstones
            self._tombstones.setdefault(uid, self._clock())
            if job:
                self._pods.get(_key(obj, job), {}).pop(uid, None)
            return not known

    def unfill(self, namespace: str, job: str) -> None:
        """The next reconcile of the job reads its pods (and the job) afresh."""
        with self._lock:
            self._filled.pop((namespace, job), None)
            self._stale.add((namespace, job))

    def forget(self, namespace: str, job: str) -> None:
        """The job is gone: drop its pods and its job object."""
        key = (namespace, job)
        with self._lock:
            self._jobs.pop(key, None)
            self._pods.pop(key, None)
            self._filled.pop(key, None)
            self._stale.discard(key)

    def sizes(self) -> tuple[int, int]:
        """(jobs, pods) held."""
        with self._lock:
            return len(self._jobs), sum(len(p) for p in self._pods.values())

    def _expire_tombstones(self) -> None:
        # Oldest first (insertion order): stop at the first one still young.
        cutoff = self._clock() - TOMBSTONE_SECONDS
        while self._tombstones:
            uid, when = next(iter(self._tombstones.items()))
            if when >= cutoff:
                break
            del self._tombstones[uid]


def _list_rv(listing: Mapping[str, Any]) -> dict[str, Any]:
    """The list's resourceVersion, in an object's shape (for ``newer_or_same``)."""
    return {"metadata": {"resourceVersion": (listing.get("metadata") or {})
                         .get("resourceVersion")}}


def _uid(obj: Mapping[str, Any]) -> str:
    return obj["metadata"].get("uid", "")


def _key(obj: Mapping[str, Any], name: str | None) -> Key:
    return obj["metadata"].get("namespace", ""), name or ""
