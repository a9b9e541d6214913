"""What a TensorFlow 1.x name is called here: the hint an ``AttributeError`` of ``fm``,
``fm.nn`` and ``fm.train`` carries.

A script ported from TF1 fails on the first name Flowmill spells differently, or does
not have. The error then says what to write instead (``tf.to_float`` is
``fm.cast(x, fm.float32)``), or what Flowmill does in its place (``SyncReplicasOptimizer``
is the job manifest's ``training.mode: sync``); for any other unknown name, the closest
names the namespace has.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

_JOB = "the job builds it: see README.md, 'One script, three ways to run it'"

# namespace ("fm", "fm.nn", "fm.train") -> TF1 name -> what to use here
HINTS: dict[str, dict[str, str]] = {
    "fm": {
        "to_float": "fm.cast(x, fm.float32)",
        "to_int32": "fm.cast(x, fm.int32)",
        "to_int64": "fm.cast(x, fm.int64)",
        "div": "fm.divide", "truediv": "fm.divide", "mul": "fm.multiply",
        "sub": "fm.subtract", "neg": "fm.negative", "mod": "fm.floormod",
        "pack": "fm.stack", "unpack": "fm.unstack", "select": "fm.where",
        "concat_v2": "fm.concat", "Print": "fm.print",
        "initialize_all_variables": "fm.global_variables_initializer",
        "all_variables": "fm.global_variables",
        "InteractiveSession": "fm.Session() (in a with block, it is the default session)",
        "variable_op_scope": "fm.variable_scope",
    },
    "fm.nn": {
        "xw_plus_b": "fm.nn.bias_add(fm.matmul(x, w), b)",
        "softmax_cross_entropy_with_logits_v2": "fm.nn.softmax_cross_entropy_with_logits",
        "batch_normalization": "fm.layers.batch_normalization, or fm.nn.fused_batch_norm",
        "relu6": "fm.minimum(fm.nn.relu(x), 6.0)",
        "softplus": "fm.log(fm.exp(x) + 1.0)",
    },
    "fm.train": {
        "SyncReplicasOptimizer": "the job manifest's spec.training.mode: sync (" + _JOB + ")",
        "replica_device_setter": "nothing: a job's variables go to its PS tasks, least bytes first",
        "ClusterSpec": "a job manifest run by `flowmill run JOB.yaml --local` or the operator",
        "Server": "a job manifest run by `flowmill run JOB.yaml --local` or the operator",
        "MonitoredTrainingSession": "fm.Session(): in a task of a job it restores, "
        "initializes and checkpoints as the manifest says",
        "Supervisor": "fm.Session(): in a task of a job it restores, initializes and "
        "checkpoints as the manifest says",
        "Saver": "the job's checkpoints (spec.checkpoint), or flowmill.runtime.saver.Saver",
        "AdagradDAOptimizer": "fm.train.Adagrad (Adagrad dual averaging is not here)",
        "FtrlOptimizer": "fm.train.Adagrad or fm.train.Adam (FTRL is not here)",
        "ProximalAdagradOptimizer": "fm.train.Adagrad (the proximal variant is not here)",
        "ProximalGradientDescentOptimizer": "fm.train.GradientDescent",
    },
}


def missing(namespace: str, name: str, available: Iterable[str]) -> AttributeError:
    """The error for ``namespace.name``: a hint for a TF1 name, else the closest names."""
    message = f"{namespace} has no attribute {name!r}"
    hint = HINTS.get(namespace, {}).get(name)
    if hint is not None:
        return AttributeError(f"{message}: TensorFlow 1.x's {name} is {hint} here")
    close = difflib.get_close_matches(name, sorted(available), n=3, cutoff=0.75)
    if close:
        return AttributeError(f"{message}; did you mean {', '.join(close)}?")
    return AttributeError(message)
