"""The node stand-in's secret volumes, as the kubelet would lay them out (pure parts)."""

from __future__ import annotations

import pytest

from .podspec import MissingRef, remount, secret_files

SECRET = {"ca.crt": b"CA", "worker-1.crt": b"CERT", "worker-1.key": b"KEY", "other": b"x"}


def pod(volume: dict, mount_path: str = "/var/run/tls") -> tuple[dict, dict]:
    container = {"name": "main", "volumeMounts": [{"name": "tls", "mountPath": mount_path}]}
    return ({"metadata": {"namespace": "ml"},
             "spec": {"volumes": [{"name": "tls", **volume}], "containers": [container]}},
            container)


def lookup(ns: str, name: str) -> dict[str, bytes] | None:
    return SECRET if (ns, name) == ("ml", "job-tls") else None


def test_items_pick_and_rename_keys_and_no_items_mounts_every_key():
    items = [{"key": "ca.crt", "path": "ca.crt"}, {"key": "worker-1.crt", "path": "tls.crt"}]
    p, c = pod({"secret": {"secretName": "job-tls", "items": items}})
    assert secret_files(p, c, lookup) == {"/var/run/tls": {"ca.crt": b"CA", "tls.crt": b"CERT"}}
    p, c = pod({"secret": {"secretName": "job-tls"}})
    assert secret_files(p, c, lookup) == {"/var/run/tls": SECRET}


def test_a_missing_secret_or_key_is_a_config_error_unless_optional():
    p, c = pod({"secret": {"secretName": "gone"}})
    with pytest.raises(MissingRef, match="secret ml/gone not found"):
        secret_files(p, c, lookup)
    p, c = pod({"secret": {"secretName": "gone", "optional": True}})
    assert secret_files(p, c, lookup) == {}
    p, c = pod({"secret": {"secretName": "job-tls", "items": [{"key": "nope", "path": "x"}]}})
    with pytest.raises(MissingRef, match="has no key 'nope'"):
        secret_files(p, c, lookup)
    p, c = pod({"emptyDir": {}})
    assert secret_files(p, c, lookup) == {}


def test_env_values_naming_a_mount_path_point_at_its_stand_in():
    env = {"A": "/var/run/tls", "B": "/var/run/tls/ca.crt", "C": "/var/run/tlsx", "D": "x"}
    assert remount(env, {"/var/run/tls": "/tmp/pod/v/0"}) == {
        "A": "/tmp/pod/v/0", "B": "/tmp/pod/v/0/ca.crt", "C": "/var/run/tlsx", "D": "x"}
