from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_ALIVE: _ClassVar[MemberState]
    MEMBER_STATE_SUSPECT: _ClassVar[MemberState]
    MEMBER_STATE_DEAD: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]
MEMBER_STATE_ALIVE: MemberState
MEMBER_STATE_SUSPECT: MemberState
MEMBER_STATE_DEAD: MemberState
MEMBER_STATE_LEFT: MemberState

class Packet(_message.Message):
    __slots__ = ("sender", "sender_addr", "msgs")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SENDER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MSGS_FIELD_NUMBER: _ClassVar[int]
    sender: str
    sender_addr: str
    msgs: _containers.RepeatedCompositeFieldContainer[Message]
    def __init__(self, sender: _Optional[str] = ..., sender_addr: _Optional[str] = ..., msgs: _Optional[_Iterable[_Union[Message, _Mapping]]] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("section", "key")
    SECTION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    section: str
    key: str
    def __init__(self, section: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("found", "data")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found: bool
    data: bytes
    def __init__(self, found: bool = ..., data: _Optional[bytes] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("ping", "ack", "nack", "ping_req", "alive", "suspect", "dead", "leave", "app", "push_pull")
    PING_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    PING_REQ_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    DEAD_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    PUSH_PULL_FIELD_NUMBER: _ClassVar[int]
    ping: Ping
    ack: Ack
    nack: Nack
    ping_req: PingReq
    alive: Alive
    suspect: Suspect
    dead: Dead
    leave: Leave
    app: AppBroadcast
    push_pull: PushPull
    def __init__(self, ping: _Optional[_Union[Ping, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., nack: _Optional[_Union[Nack, _Mapping]] = ..., ping_req: _Optional[_Union[PingReq, _Mapping]] = ..., alive: _Optional[_Union[Alive, _Mapping]] = ..., suspect: _Optional[_Union[Suspect, _Mapping]] = ..., dead: _Optional[_Union[Dead, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ..., app: _Optional[_Union[AppBroadcast, _Mapping]] = ..., push_pull: _Optional[_Union[PushPull, _Mapping]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("seq", "target")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    seq: int
    target: str
    def __init__(self, seq: _Optional[int] = ..., target: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Nack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class PingReq(_message.Message):
    __slots__ = ("seq", "target", "target_addr", "nack")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDR_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    seq: int
    target: str
    target_addr: str
    nack: bool
    def __init__(self, seq: _Optional[int] = ..., target: _Optional[str] = ..., target_addr: _Optional[str] = ..., nack: bool = ...) -> None: ...

class Alive(_message.Message):
    __slots__ = ("node", "addr", "incarnation")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node: str
    addr: str
    incarnation: int
    def __init__(self, node: _Optional[str] = ..., addr: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Suspect(_message.Message):
    __slots__ = ("node", "incarnation", "accuser")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ACCUSER_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    accuser: str
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., accuser: _Optional[str] = ...) -> None: ...

class Dead(_message.Message):
    __slots__ = ("node", "incarnation", "accuser")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ACCUSER_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    accuser: str
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., accuser: _Optional[str] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("node", "incarnation")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class AppBroadcast(_message.Message):
    __slots__ = ("origin", "key", "seq", "payload")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    origin: str
    key: str
    seq: int
    payload: bytes
    def __init__(self, origin: _Optional[str] = ..., key: _Optional[str] = ..., seq: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class MemberRow(_message.Message):
    __slots__ = ("node", "addr", "incarnation", "state")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    node: str
    addr: str
    incarnation: int
    state: MemberState
    def __init__(self, node: _Optional[str] = ..., addr: _Optional[str] = ..., incarnation: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ...) -> None: ...

class PushPull(_message.Message):
    __slots__ = ("join", "reply", "rows", "app_state")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    APP_STATE_FIELD_NUMBER: _ClassVar[int]
    join: bool
    reply: bool
    rows: _containers.RepeatedCompositeFieldContainer[MemberRow]
    app_state: bytes
    def __init__(self, join: bool = ..., reply: bool = ..., rows: _Optional[_Iterable[_Union[MemberRow, _Mapping]]] = ..., app_state: _Optional[bytes] = ...) -> None: ...

class AppState(_message.Message):
    __slots__ = ("parts",)
    class PartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.ScalarMap[str, bytes]
    def __init__(self, parts: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
