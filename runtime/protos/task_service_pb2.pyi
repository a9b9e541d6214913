from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterGraphRequest(_message.Message):
    __slots__ = ("graph_def", "session_handle")
    GRAPH_DEF_FIELD_NUMBER: _ClassVar[int]
    SESSION_HANDLE_FIELD_NUMBER: _ClassVar[int]
    graph_def: bytes
    session_handle: str
    def __init__(self, graph_def: _Optional[bytes] = ..., session_handle: _Optional[str] = ...) -> None: ...

class RegisterGraphResponse(_message.Message):
    __slots__ = ("graph_handle",)
    GRAPH_HANDLE_FIELD_NUMBER: _ClassVar[int]
    graph_handle: str
    def __init__(self, graph_handle: _Optional[str] = ...) -> None: ...

class RunGraphRequest(_message.Message):
    __slots__ = ("graph_handle", "step_id", "cleanup_step_ids")
    GRAPH_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CLEANUP_STEP_IDS_FIELD_NUMBER: _ClassVar[int]
    graph_handle: str
    step_id: int
    cleanup_step_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, graph_handle: _Optional[str] = ..., step_id: _Optional[int] = ..., cleanup_step_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RunGraphResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CleanupStepRequest(_message.Message):
    __slots__ = ("step_id", "more_step_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_STEP_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    more_step_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., more_step_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CleanupStepResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("role", "index", "task", "tensor_address", "num_graphs", "pid", "unreceived_values", "tensor_local_address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UNRECEIVED_VALUES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_LOCAL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    task: str
    tensor_address: str
    num_graphs: int
    pid: int
    unreceived_values: int
    tensor_local_address: str
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., task: _Optional[str] = ..., tensor_address: _Optional[str] = ..., num_graphs: _Optional[int] = ..., pid: _Optional[int] = ..., unreceived_values: _Optional[int] = ..., tensor_local_address: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
