"""Reading TrainingJobs and their pods through the Python client (cheaper than a kubectl
process per poll), for the tests that run jobs under the operator."""

from __future__ import annotations

import json
from collections.abc import Callable

from kubernetes import client

from flowmill.operator.api import GROUP, PLURAL, VERSION
from flowmill.operator.manifests import LABEL_JOB

from .cluster import Cluster
from .polling import eventually

FINISHED = ("Succeeded", "Failed")


class JobReader:
    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.ns = cluster, namespace
        api = cluster.api()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def job(self, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                            name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def pods(self, selector: str) -> list[dict]:
        resp = self.core.list_namespaced_pod(self.ns, label_selector=selector,
                                             _preload_content=False)
        return json.loads(resp.data)["items"]

    def live_pods(self, job: str) -> dict[str, dict]:
        """The job's pods that are not being deleted, by name."""
        return {p["metadata"]["name"]: p for p in self.pods(f"{LABEL_JOB}={job}")
                if not p["metadata"].get("deletionTimestamp")}

    def phase(self, name: str, phase: str, timeout: float,
              each: Callable[[dict], None] | None = None) -> dict:
        """Wait for ``phase``; fail at once if the job ends in another. ``each`` sees the
        job's status at every poll."""

        def check() -> dict | None:
            tj = self.job(name) or {}
            status = tj.get("status") or {}
            if each is not None:
                each(status)
            got = status.get("phase")
            if got in FINISHED and got != phase:
                raise AssertionError(f"{name} ended {got}, not {phase}: "
                                     f"{json.dumps(status, indent=1)}")
            return tj if got == phase else None

        return eventually(f"{name} to be {phase}", check, timeout, interval=0.3)
