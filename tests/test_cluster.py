"""The cluster spec every task reads from its environment."""

import json

import pytest

from flowmill.runtime.cluster import ENV_VAR, ClusterSpecError, TaskConfig, from_env
from flowmill.runtime.device_names import task_of

SPEC = {
    "cluster": {"ps": ["10.0.0.1:2222"], "worker": ["w0:2222", "w1:2222"]},
    "task": {"type": "worker", "index": 1},
}


def test_round_trip_and_properties():
    config = from_env({ENV_VAR: json.dumps(SPEC)})
    assert (config.role, config.index, config.address) == ("worker", 1, "w1:2222")
    assert config.device == "/job:worker/task:1/device:CPU:0"
    assert not config.is_chief
    assert TaskConfig.from_json(config.to_json()) == config
    assert config.cluster.tasks() == [("ps", 0), ("worker", 0), ("worker", 1)]


def test_chief_is_worker_zero_without_a_chief_task():
    spec = dict(SPEC, task={"type": "worker", "index": 0})
    assert TaskConfig.from_json(json.dumps(spec)).is_chief
    with_chief = {
        "cluster": {**SPEC["cluster"], "chief": ["c:1"]},
        "task": {"type": "chief", "index": 0},
    }
    assert TaskConfig.from_json(json.dumps(with_chief)).is_chief


def test_single_process_without_the_variable():
    assert from_env({}) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"cluster": {}}), "'cluster' and 'task'"),
        (json.dumps({**SPEC, "cluster": {"boss": ["a:1"]}}), "unknown role 'boss'"),
        (json.dumps({**SPEC, "cluster": {"worker": "a:1"}}), r"cluster.worker must be a list"),
        (
            json.dumps({**SPEC, "cluster": {"worker": ["nohost"]}}),
            r"cluster.worker\[0\] must be 'host:port'",
        ),
        (json.dumps({**SPEC, "task": {"type": "worker", "index": 5}}), "worker has 2 tasks"),
        (json.dumps({**SPEC, "task": {"type": "worker", "index": "1"}}), "must be an integer"),
    ],
)
def test_bad_specs_name_the_field(text, message):
    with pytest.raises(ClusterSpecError, match=message):
        TaskConfig.from_json(text)


def test_task_of_device():
    assert task_of("/job:ps/task:1/device:CPU:0") == "/job:ps/task:1"
