from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GraphDef(_message.Message):
    __slots__ = ("node", "fetch", "target", "num_feeds")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_FEEDS_FIELD_NUMBER: _ClassVar[int]
    node: _containers.RepeatedCompositeFieldContainer[NodeDef]
    fetch: _containers.RepeatedCompositeFieldContainer[TensorRef]
    target: _containers.RepeatedScalarFieldContainer[str]
    num_feeds: int
    def __init__(self, node: _Optional[_Iterable[_Union[NodeDef, _Mapping]]] = ..., fetch: _Optional[_Iterable[_Union[TensorRef, _Mapping]]] = ..., target: _Optional[_Iterable[str]] = ..., num_feeds: _Optional[int] = ...) -> None: ...

class NodeDef(_message.Message):
    __slots__ = ("name", "op", "device", "input", "control_input", "attr", "output_dtype", "output_shape", "frame", "loop_role", "in_control_flow")
    class AttrEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: AttrValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AttrValue, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_INPUT_FIELD_NUMBER: _ClassVar[int]
    ATTR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    LOOP_ROLE_FIELD_NUMBER: _ClassVar[int]
    IN_CONTROL_FLOW_FIELD_NUMBER: _ClassVar[int]
    name: str
    op: str
    device: str
    input: _containers.RepeatedCompositeFieldContainer[TensorRef]
    control_input: _containers.RepeatedScalarFieldContainer[str]
    attr: _containers.MessageMap[str, AttrValue]
    output_dtype: _containers.RepeatedScalarFieldContainer[str]
    output_shape: _containers.RepeatedCompositeFieldContainer[TensorShape]
    frame: _containers.RepeatedScalarFieldContainer[str]
    loop_role: str
    in_control_flow: bool
    def __init__(self, name: _Optional[str] = ..., op: _Optional[str] = ..., device: _Optional[str] = ..., input: _Optional[_Iterable[_Union[TensorRef, _Mapping]]] = ..., control_input: _Optional[_Iterable[str]] = ..., attr: _Optional[_Mapping[str, AttrValue]] = ..., output_dtype: _Optional[_Iterable[str]] = ..., output_shape: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., frame: _Optional[_Iterable[str]] = ..., loop_role: _Optional[str] = ..., in_control_flow: _Optional[bool] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("node", "index")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    node: str
    index: int
    def __init__(self, node: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dim", "unknown_rank")
    DIM_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_RANK_FIELD_NUMBER: _ClassVar[int]
    dim: _containers.RepeatedScalarFieldContainer[int]
    unknown_rank: bool
    def __init__(self, dim: _Optional[_Iterable[int]] = ..., unknown_rank: _Optional[bool] = ...) -> None: ...

class TensorProto(_message.Message):
    __slots__ = ("dtype", "shape", "content", "scalar")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: TensorShape
    content: bytes
    scalar: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Union[TensorShape, _Mapping]] = ..., content: _Optional[bytes] = ..., scalar: _Optional[bool] = ...) -> None: ...

class ListValue(_message.Message):
    __slots__ = ("value", "is_list")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    IS_LIST_FIELD_NUMBER: _ClassVar[int]
    value: _containers.RepeatedCompositeFieldContainer[AttrValue]
    is_list: bool
    def __init__(self, value: _Optional[_Iterable[_Union[AttrValue, _Mapping]]] = ..., is_list: _Optional[bool] = ...) -> None: ...

class NoneValue(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttrValue(_message.Message):
    __slots__ = ("i", "f", "b", "s", "tensor", "dtype", "shape", "list", "none")
    I_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    i: int
    f: float
    b: bool
    s: str
    tensor: TensorProto
    dtype: str
    shape: TensorShape
    list: ListValue
    none: NoneValue
    def __init__(self, i: _Optional[int] = ..., f: _Optional[float] = ..., b: _Optional[bool] = ..., s: _Optional[str] = ..., tensor: _Optional[_Union[TensorProto, _Mapping]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Union[TensorShape, _Mapping]] = ..., list: _Optional[_Union[ListValue, _Mapping]] = ..., none: _Optional[_Union[NoneValue, _Mapping]] = ...) -> None: ...
