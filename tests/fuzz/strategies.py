"""Hypothesis strategies over proto descriptors: any pdmesh request, valid or not.

`message_strategy(cls, hints)` draws a `cls` message field by field from the
descriptor: every scalar type over its whole wire range with its edges
(int32/uint64 min/max, NaN, +-inf, -0.0), strings with unicode edge cases
(NUL, RTL overrides, BOM, combining marks, astral planes, long runs), enum
numbers the contract does not define, nested messages, and repeated fields
from empty to tens of thousands of elements. `hints` maps a field name to a
strategy of plausible values (real token ids, the real prefill address, a
live handle id) mixed in with the rest, so that draws also get past
validation and reach the engine.

`wire_strategy(cls, hints)` gives serialized bytes a protobuf encoder would
never produce: random bytes, mutated (flipped, truncated, spliced) encodings
of valid messages, and strings carrying invalid UTF-8 such as lone surrogates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message
from hypothesis import strategies as st

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}

UNICODE_EDGES = (
    "",
    "\x00",
    "a\x00b",
    "\u202eevil\u202c",  # right-to-left override
    "\u200f\u200e",  # RTL / LTR marks
    "\ufeff",  # byte order mark
    "e\u0301\u0301\u0301",  # stacked combining marks
    "\U0001f469\u200d\U0001f469\u200d\U0001f467",  # ZWJ emoji sequence
    "\U0010ffff\uffff\ufffe",
    "\x7f\x1b[2J",  # DEL and an ANSI escape
    "../../etc/passwd",
    "%s%n{0}",
    "127.0.0.1:1",
    "[::1]:0",
    "unix:/nonexistent",
    "dns:///nonexistent.invalid:80",
)

# Lone surrogates cannot be set on a message; on the wire they are invalid UTF-8.
_BAD_UTF8 = (b"\xed\xa0\x80", b"\xff", b"\xc0\x80", b"\xe0\x80", b"a\x80b", b"\xf4\x90\x80\x80")


def int_strategy(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, hi // 2, *(v for v in (-1, lo + 1, hi - 1) if lo <= v <= hi)})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -300), min(hi, 300)))


def float_strategy(width: int) -> st.SearchStrategy[float]:
    edges = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 2.0, 2.0000001, -1.0, 1e-45, 3.4e38]
    return st.one_of(
        st.sampled_from(edges),
        st.floats(width=width),
        st.floats(min_value=0.0, max_value=2.5, width=width),
    )


def text_strategy() -> st.SearchStrategy[str]:
    # Long runs are built, not listed, so failure reports stay readable: 129 bytes is
    # just over the 128-byte id limits, 65 x "é" is 65 characters but 130 bytes.
    runs = st.builds(
        lambda c, n: c * n, st.sampled_from(["a", "\u00e9", "\u202e"]), st.sampled_from([65, 129, 5000])
    )
    return st.one_of(
        st.sampled_from(UNICODE_EDGES),
        runs,
        st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
    )


def scalar_strategy(field: F) -> st.SearchStrategy:
    t = field.type
    if t in _INT_RANGES:
        return int_strategy(*_INT_RANGES[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return float_strategy(64 if t == F.TYPE_DOUBLE else 32)
    if t == F.TYPE_STRING:
        return text_strategy()
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        known = sorted(v.number for v in field.enum_type.values)
        # proto3 enums are open: numbers the contract does not define are valid wire data.
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, max(known) + 1, 99, 2**31 - 1]))
    raise TypeError(f"no strategy for field type {t} ({field.full_name})")


def _repeated(elem: st.SearchStrategy) -> st.SearchStrategy[list]:
    # Mostly short lists; sometimes a long run of one value, as a huge field costs
    # nothing to draw that way (the server's message limit still bounds it).
    long_run = st.builds(lambda v, n: [v] * n, elem, st.sampled_from([1000, 20_000, 200_000]))
    return st.one_of(st.lists(elem, max_size=6), st.lists(elem, max_size=300), long_run)


class MessageStrategies:
    """Builds (and caches) strategies for message classes under one set of hints."""

    def __init__(self, hints: Mapping[str, st.SearchStrategy] | None = None, max_depth: int = 3):
        self.hints = dict(hints or {})
        self.max_depth = max_depth

    def field_value(self, field: F, depth: int) -> st.SearchStrategy:
        if field.type == F.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                return st.nothing()
            return self.message(field.message_type._concrete_class, depth + 1)
        base = scalar_strategy(field)
        hint = self._hint(field, field.name)
        return base if hint is None else st.one_of(hint, hint, base)

    def _hint(self, field: F, key: str) -> st.SearchStrategy | None:
        """The hint for `key` ("Message.field" first, then the bare field name);
        a hint of None for "Message.field" switches the bare one off there."""
        qualified = f"{field.containing_type.name}.{key}"
        if qualified in self.hints:
            return self.hints[qualified]
        return self.hints.get(key)

    def message(self, cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
        if depth > self.max_depth:
            return st.just(cls())
        optional: dict[str, st.SearchStrategy] = {}
        for field in cls.DESCRIPTOR.fields:
            value = self.field_value(field, depth)
            if field.is_repeated:
                if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                    continue
                list_hint = self._hint(field, f"{field.name}[]")
                value = _repeated(value) if list_hint is None else st.one_of(list_hint, _repeated(value))
            optional[field.name] = value
        return st.fixed_dictionaries({}, optional=optional).map(lambda d: _build(cls, d))


# Big enough to go over every server's message cap, small enough to draw by the hundred.
MAX_DRAW_BYTES = 16 * 1024 * 1024


def _wire_bytes(value) -> int:
    """About what one element of a repeated field costs on the wire (tag and length included)."""
    if isinstance(value, Message):
        return value.ByteSize() + 6
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 6
    if isinstance(value, bytes):
        return len(value) + 6
    return 11


def _within(values: list, room: int) -> list:
    """The longest prefix of `values` that fits in `room` bytes (sizes memoised: long runs
    repeat one object)."""
    sizes: dict[int, int] = {}
    total = 0
    for i, v in enumerate(values):
        size = sizes.get(id(v))
        if size is None:
            size = sizes[id(v)] = _wire_bytes(v)
        total += size
        if total > room:
            return values[:i]
    return values


def _build(cls: type[Message], values: dict, budget: int = MAX_DRAW_BYTES) -> Message:
    """`cls` with `values`; repeated fields are cut short where the message would pass `budget`
    bytes (nested messages are built first, each within the budget, so the whole stays near it)."""
    msg = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        if field.is_repeated:
            value = _within(value, budget - msg.ByteSize())
            target = getattr(msg, name)
            if field.type == F.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bad_string_field(cls: type[Message]) -> st.SearchStrategy[bytes]:
    """A length-delimited field with invalid UTF-8 at a string field's number."""
    numbers = [f.number for f in cls.DESCRIPTOR.fields if f.type == F.TYPE_STRING] or [1]
    return st.builds(
        lambda n, bad, pre, post: _varint(n << 3 | 2) + _varint(len(pre + bad + post)) + pre + bad + post,
        st.sampled_from(numbers),
        st.sampled_from(_BAD_UTF8),
        st.binary(max_size=4),
        st.binary(max_size=4),
    )


def _mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, value in ops:
        if not buf:
            buf = bytearray([value])
            continue
        i = pos % len(buf)
        if kind == 0:
            buf[i] ^= 1 << (value % 8)
        elif kind == 1:
            del buf[i:]
        elif kind == 2:
            buf[i:i] = bytes([value])
        else:
            buf[i] = value
    return bytes(buf)


def wire_strategy(cls: type[Message], strategies: MessageStrategies) -> st.SearchStrategy[bytes]:
    """Bytes that claim to be a `cls`: mostly malformed."""
    ops = st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=4
    )
    valid = strategies.message(cls).map(lambda m: m.SerializeToString())
    return st.one_of(
        st.binary(max_size=256),
        st.builds(_mutate, valid, ops),
        _bad_string_field(cls),
        st.builds(lambda good, bad: good + bad, valid, _bad_string_field(cls)),
        st.sampled_from(
            [b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 11, b"\x0b", b"\x0c"]
        ),
    )
