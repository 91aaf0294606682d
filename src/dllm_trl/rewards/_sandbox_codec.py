"""Data-only codec and message framing shared by the code-reward judge and executor.

Standalone (stdlib only, no package imports): the source of this file is prepended to the judge and
executor programs that :mod:`dllm_trl.rewards.code` runs with ``python -I -S -c``.

Values cross the process boundary as tagged JSON, and the *decoder* (which, in the trusted judge,
reads what the untrusted executor sent) only ever builds objects of trusted types: ``None``,
``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``, ``list``, ``tuple``,
``set``, ``frozenset``, ``dict``, ``range``, ``slice``, ``collections.deque`` / ``Counter`` /
``OrderedDict`` / ``defaultdict`` (builtin factory), ``list_iterator`` (iterators are exhausted by
the sender, unless it sends them as references with ``lazy=True``), dict views,
``Fraction``, ``Decimal``, ``datetime.date`` / ``datetime`` / ``time`` / ``timedelta``, namedtuples
(a namedtuple class the decoder makes itself from the field names, so equality is tuple equality)
enum members (class and member name, with the sender's handle: the judge maps them to its own members of an enum it
models), and :class:`Record` (a dataclass instance as its class name and field values; equality compares
those, never the candidate's ``__eq__``; the judge's models of the program's classes, when set in
``Record.MODELS``, say which fields compare and whether they order). Subclasses of builtin types
travel as their builtin base. A decoded record / namedtuple is handed to ``resolve("dc" / "nt", value)``
(the executor rebuilds the program's instance from it).

Anything else is handed to the sender's ``fallback`` hook (the executor turns other objects into
*handles*, the judge turns callables into *callbacks*); the receiver's ``resolve`` hook maps the
tags ``h`` / ``cb`` back. Without hooks such values raise ``TypeError`` / ``CodecError``.

Framing: 4-byte big-endian length, then UTF-8 JSON. Messages larger than the receiver's limit are
a protocol error.
"""

import base64
import collections
import datetime
import decimal
import fractions
import json
import math
import os
import select
import struct
import time

MAX_DEPTH = 200
MAX_FIELDS = 256


class CodecError(Exception):
    pass


class ChannelClosed(Exception):
    pass


class ChannelTimeout(Exception):
    pass


class Record:
    """A dataclass instance received as data: class name, field names and values, and (optionally)
    the sender's handle of the original object so that it can be passed back unchanged."""

    __slots__ = ("_name", "_fields", "_values", "_handle", "_given")
    MODELS = {}  # judge: class name -> its model of a dataclass of the program (compare / order / text)
    MATERIALIZE = None  # judge: record -> handle of the program's own instance built from it

    def __init__(self, name, fields, values, handle=None, given=()):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fields", tuple(fields))
        object.__setattr__(self, "_values", tuple(values))
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_given", frozenset(given))  # field indices the judge's caller gave

    def __getattr__(self, name):
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return object.__getattribute__(self, "_values")[fields.index(name)]
        if not name.startswith("__"):
            handle = object.__getattribute__(self, "_own")()
            if handle is not None:
                return getattr(handle, name)  # methods of the dataclass: asked of the original object
        raise AttributeError(name)

    def __setattr__(self, name, value):
        raise AttributeError("a record received from the sandbox is read-only")

    def _compared(self, other=None):
        """The values equality looks at: the fields the judge's model of the class compares
        (``field(compare=False)`` left out, unless the test gave that field a value itself when it
        built either record), else every field."""
        model = Record.MODELS.get(self._name)
        if model is None or model.fields != self._fields:
            return self._values
        index = set(model.compare_index) | self._given | (other._given if other is not None else frozenset())
        return tuple(self._values[i] for i in sorted(index))

    def __eq__(self, other):
        if type(other) is not Record:
            return NotImplemented
        if self is other:
            return True
        if self._name != other._name or self._fields != other._fields:
            return False
        return self._compared(other) == other._compared(self)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def _order(self, other, op):
        model = Record.MODELS.get(self._name)
        if (type(other) is not Record or model is None or not model.order or self._name != other._name
                or self._fields != other._fields or model.fields != self._fields):
            return NotImplemented  # ordering only for a dataclass(order=True) the judge modelled
        return op(self._compared(other), other._compared(self))

    def __lt__(self, other):
        return self._order(other, lambda a, b: a < b)

    def __le__(self, other):
        return self._order(other, lambda a, b: a <= b)

    def __gt__(self, other):
        return self._order(other, lambda a, b: a > b)

    def __ge__(self, other):
        return self._order(other, lambda a, b: a >= b)

    def __hash__(self):
        return hash((self._name, self._fields, self._compared()))

    def _default_repr(self):
        inner = ", ".join("%s=%r" % kv for kv in zip(self._fields, self._values))
        return "%s(%s)" % (self._name, inner)

    def _own(self):
        """The original object (asked of the sender), or None."""
        handle = object.__getattribute__(self, "_handle")
        if handle is None and Record.MATERIALIZE is not None and Record.MODELS.get(self._name) is not None:
            handle = Record.MATERIALIZE(self)  # a value the judge built: handed to the program
            object.__setattr__(self, "_handle", handle)
        return handle

    def __repr__(self):
        return _record_text(self, repr)

    def __str__(self):
        return _record_text(self, str)


def _record_text(record, convert):
    """``convert`` (repr or str) of the program's own object behind ``record`` where it has one, else the record's
    default repr. A function, not a method: a method name would hide a record field of the same name."""
    model = Record.MODELS.get(record._name)
    if record._handle is not None or (model is not None and model.own_text):
        try:
            own = record._own()
            if own is not None:
                return convert(own)
        except Exception:
            pass
    return record._default_repr()


_NAMEDTUPLES = {}


def _namedtuple_class(name, fields):
    key = (name, fields)
    if key not in _NAMEDTUPLES:
        if len(_NAMEDTUPLES) > 1000:
            _NAMEDTUPLES.clear()
        _NAMEDTUPLES[key] = collections.namedtuple(name, fields)
    return _NAMEDTUPLES[key]


def _is_namedtuple(obj):
    fields = getattr(type(obj), "_fields", None)
    return isinstance(fields, tuple) and all(type(f) is str for f in fields)


def _dataclass_fields(obj):
    """Field names of a dataclass *instance*, else None (no import of dataclasses needed)."""
    spec = getattr(type(obj), "__dataclass_fields__", None)
    if not isinstance(spec, dict) or isinstance(obj, type):
        return None
    return [name for name, f in spec.items() if getattr(f, "_field_type", None) is None or
            getattr(getattr(f, "_field_type", None), "name", "") == "_FIELD"]


_PLAIN = frozenset((int, float, complex, str, bytes, bytearray, tuple, list, dict, set, frozenset, type(None), bool))


def _enum_member_name(obj):
    """The member name of an enum member (its class has a member map), else None."""
    if not isinstance(getattr(type(obj), "_member_map_", None), dict) or isinstance(obj, type):
        return None
    name = getattr(obj, "_name_", None)
    return name[:200] if type(name) is str else None


_FACTORIES = {list: "list", dict: "dict", set: "set", int: "int", str: "str", float: "float", tuple: "tuple"}
_FACTORY_NAMES = {v: k for k, v in _FACTORIES.items()}


def _is_iterator(obj):
    t = type(obj)
    return hasattr(t, "__next__") and hasattr(t, "__iter__")


def encode_value(obj, fallback=None, _depth=0, lazy=False):
    """Value -> JSON-compatible tagged structure. ``fallback(obj)`` (optional) encodes values of
    other types, returning a tagged dict; without it they raise ``TypeError``. ``lazy``: iterators
    go to ``fallback`` (a handle) instead of being exhausted."""
    if _depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = _depth + 1

    def enc(x):
        return encode_value(x, fallback, d, lazy)

    t = type(obj)
    if obj is None or obj is True or obj is False:
        return obj
    if isinstance(obj, Record):
        handle = obj._handle
        if handle is not None and fallback is not None:
            return fallback(obj)
        return {"dc": [obj._name, list(obj._fields), [enc(v) for v in obj._values], None]}
    if fallback is not None and t not in _PLAIN:
        if getattr(t, "_judge_enum_member", False) is True:
            return fallback(obj)  # the judge's own member of an IntEnum / StrEnum
        member = _enum_member_name(obj)
        if member is not None:  # an enum member: class, name, handle, and the value of an int / str enum
            value = int.__index__(obj) if isinstance(obj, int) else str.__str__(obj) if isinstance(obj, str) else None
            return {"em": [str(t.__name__)[:100], member, fallback(obj), None if value is None else enc(value)]}
    if isinstance(obj, tuple) and _is_namedtuple(obj):
        fields = list(type(obj)._fields)[:MAX_FIELDS]
        return {"nt": [str(type(obj).__name__)[:100], fields, [enc(x) for x in tuple.__iter__(obj)]]}
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        v = int.__index__(obj)
        if -(1 << 53) < v < (1 << 53):
            return v
        return {"i": format(v, "x")}
    if isinstance(obj, float):
        v = float.__float__(obj) if t is not float else obj
        if math.isfinite(v):
            return v
        return {"x": "nan" if v != v else ("inf" if v > 0 else "-inf")}
    if isinstance(obj, complex):
        v = complex(obj.real, obj.imag) if t is not complex else obj
        return {"c": [encode_value(float(v.real), None, d), encode_value(float(v.imag), None, d)]}
    if isinstance(obj, str):
        return obj if t is str else str.__str__(obj)
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, bytearray):
        return {"ba": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, tuple):
        return {"t": [enc(x) for x in tuple.__iter__(obj)]}
    if isinstance(obj, list):
        return {"l": [enc(x) for x in list.__iter__(obj)]}
    if isinstance(obj, frozenset):
        return {"fs": [enc(x) for x in frozenset.__iter__(obj)]}
    if isinstance(obj, set):
        return {"s": [enc(x) for x in set.__iter__(obj)]}
    if t is collections.Counter:
        return {"ctr": [[enc(k), enc(v)] for k, v in dict.items(obj)]}
    if t is collections.OrderedDict:
        return {"od": [[enc(k), enc(v)] for k, v in dict.items(obj)]}
    if t is collections.defaultdict and obj.default_factory in _FACTORIES:
        return {"dd": [_FACTORIES[obj.default_factory], [[enc(k), enc(v)] for k, v in dict.items(obj)]]}
    if isinstance(obj, dict):
        return {"d": [[enc(k), enc(v)] for k, v in dict.items(obj)]}
    if t is range:
        return {"r": [obj.start, obj.stop, obj.step]}
    if t is slice:
        return {"sl": [enc(obj.start), enc(obj.stop), enc(obj.step)]}
    if isinstance(obj, collections.deque):
        return {"dq": [enc(x) for x in list(obj)]}
    if t is type({}.keys()):
        return {"dk": [enc(x) for x in obj]}
    if t is type({}.values()):
        return {"dv": [enc(x) for x in obj]}
    if t is type({}.items()):
        return {"di": [[enc(k), enc(v)] for k, v in obj]}
    if isinstance(obj, fractions.Fraction):
        return {"fr": [enc(int(obj.numerator)), enc(int(obj.denominator))]}
    if isinstance(obj, decimal.Decimal):
        return {"dec": str(decimal.Decimal.__str__(obj))}
    if isinstance(obj, datetime.timedelta):
        return {"td": [obj.days, obj.seconds, obj.microseconds]}
    if isinstance(obj, datetime.datetime):
        return {"dt": datetime.datetime.isoformat(obj)}
    if isinstance(obj, datetime.date):
        return {"da": datetime.date.isoformat(obj)}
    if isinstance(obj, datetime.time):
        return {"tm": datetime.time.isoformat(obj)}
    fields = _dataclass_fields(obj)
    if fields is not None and len(fields) <= MAX_FIELDS:
        values = [enc(getattr(obj, f)) for f in fields]
        handle = fallback(obj) if fallback is not None else None
        return {"dc": [str(t.__name__)[:100], [str(f) for f in fields], values, handle]}
    if fallback is not None and getattr(t, "_sandbox_handle", False):
        return fallback(obj)  # the judge's stand-in for a sandboxed object (it iterates, but is a handle)
    if _is_iterator(obj):
        if lazy and fallback is not None:
            return fallback(obj)  # the executor keeps iterators: consumed item by item, on request
        return {"it": [enc(x) for x in obj]}
    if fallback is not None:
        return fallback(obj)
    raise TypeError("cannot transport a value of type %s" % t.__name__)


def _need(cond):
    if not cond:
        raise CodecError("malformed value")


def _identifier(s):
    return isinstance(s, str) and 0 < len(s) <= 100 and s.isidentifier() and not s.startswith("__")


def decode_value(obj, resolve=None, _depth=0):
    """Tagged structure (from untrusted JSON) -> value of a trusted type (see the module
    docstring). ``resolve(tag, v)`` (optional) maps the tags ``h`` and ``cb``. Raises CodecError."""
    if _depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    d = _depth + 1

    def dec(x):
        return decode_value(x, resolve, d)

    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    _need(isinstance(obj, dict) and len(obj) == 1)
    (tag, v), = obj.items()
    try:
        if tag == "i":
            _need(isinstance(v, str) and 0 < len(v) <= 200_000)
            return int(v, 16)
        if tag == "x":
            _need(v in ("nan", "inf", "-inf"))
            return float(v)
        if tag == "c":
            _need(isinstance(v, list) and len(v) == 2)
            re_, im = dec(v[0]), dec(v[1])
            _need(type(re_) is float and type(im) is float)
            return complex(re_, im)
        if tag in ("b", "ba"):
            _need(isinstance(v, str))
            raw = base64.b64decode(v.encode("ascii"), validate=True)
            return raw if tag == "b" else bytearray(raw)
        if tag == "r":
            _need(isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v))
            return range(v[0], v[1], v[2])
        if tag == "sl":
            _need(isinstance(v, list) and len(v) == 3)
            return slice(*[dec(x) for x in v])
        if tag in ("h", "cb"):
            _need(resolve is not None)
            return resolve(tag, v)
        if tag == "em":  # an enum member: its class and member name, and the sender's handle (or None)
            _need(resolve is not None and isinstance(v, list) and len(v) == 4 and _identifier(v[0])
                  and isinstance(v[1], str) and 0 < len(v[1]) <= 200)
            return resolve("em", v)
        if tag == "dec":
            _need(isinstance(v, str) and len(v) <= 10_000)
            return decimal.Decimal(v)
        if tag in ("dt", "da", "tm"):
            _need(isinstance(v, str) and len(v) <= 64)
            return {"dt": datetime.datetime, "da": datetime.date, "tm": datetime.time}[tag].fromisoformat(v)
        if tag == "td":
            _need(isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v))
            return datetime.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
        if tag == "fr":
            _need(isinstance(v, list) and len(v) == 2)
            num, den = dec(v[0]), dec(v[1])
            _need(type(num) is int and type(den) is int and den > 0)
            return fractions.Fraction(num, den)
        if tag == "nt":
            _need(isinstance(v, list) and len(v) == 3 and isinstance(v[1], list) and isinstance(v[2], list))
            name, fields, values = v
            _need(_identifier(name) and len(fields) <= MAX_FIELDS and all(_identifier(f) for f in fields))
            _need(len(set(fields)) == len(fields) == len(values) and not any(f.startswith("_") for f in fields))
            value = _namedtuple_class(name, tuple(fields))(*[dec(x) for x in values])
            return resolve("nt", value) if resolve is not None else value
        if tag == "dc":
            _need(isinstance(v, list) and len(v) == 4 and isinstance(v[1], list) and isinstance(v[2], list))
            name, fields, values, handle = v
            _need(_identifier(name) and len(fields) <= MAX_FIELDS and all(_identifier(f) for f in fields))
            _need(len(set(fields)) == len(fields) == len(values))
            ref = None
            if handle is not None:
                _need(resolve is not None and isinstance(handle, dict) and list(handle) == ["h"])
                ref = resolve("h", handle["h"])
            record = Record(name, fields, [dec(x) for x in values], ref)
            return resolve("dc", record) if resolve is not None and ref is None else record
        _need(isinstance(v, list))
        if tag == "t":
            return tuple(dec(x) for x in v)
        if tag == "l":
            return [dec(x) for x in v]
        if tag == "s":
            return set(dec(x) for x in v)
        if tag == "fs":
            return frozenset(dec(x) for x in v)
        if tag in ("ctr", "od"):
            out = collections.Counter() if tag == "ctr" else collections.OrderedDict()
            for kv in v:
                _need(isinstance(kv, list) and len(kv) == 2)
                out[dec(kv[0])] = dec(kv[1])
            return out
        if tag == "dd":
            _need(len(v) == 2 and v[0] in _FACTORY_NAMES and isinstance(v[1], list))
            out = collections.defaultdict(_FACTORY_NAMES[v[0]])
            for kv in v[1]:
                _need(isinstance(kv, list) and len(kv) == 2)
                out[dec(kv[0])] = dec(kv[1])
            return out
        if tag in ("d", "di"):
            out = {}
            for kv in v:
                _need(isinstance(kv, list) and len(kv) == 2)
                out[dec(kv[0])] = dec(kv[1])
            return out if tag == "d" else out.items()
        if tag == "dk":
            return dict.fromkeys(dec(x) for x in v).keys()
        if tag == "dv":
            return dict(enumerate(dec(x) for x in v)).values()
        if tag == "dq":
            return collections.deque(dec(x) for x in v)
        if tag == "it":
            return iter([dec(x) for x in v])
    except CodecError:
        raise
    except (TypeError, ValueError, RecursionError, OverflowError, MemoryError, ArithmeticError) as exc:
        raise CodecError("malformed value: %s" % type(exc).__name__)
    raise CodecError("unknown tag")


# ----------------------------------------------------------------------------- framing
def send_msg(fd, obj, deadline=None):
    """Write one framed message. With a ``deadline`` the fd must be non-blocking: a peer that stops
    reading cannot stall the sender past the deadline (ChannelTimeout)."""
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    buf = struct.pack(">I", len(data)) + data
    view = memoryview(buf)
    while view:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout()
            _, w, _ = select.select([], [fd], [], remaining)
            if not w:
                raise ChannelTimeout()
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                continue
        else:
            n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd, n, deadline):
    chunks = []
    while n > 0:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout()
            r, _, _ = select.select([fd], [], [], remaining)
            if not r:
                raise ChannelTimeout()
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise ChannelClosed()
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(fd, deadline=None, max_bytes=16 << 20):
    (n,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
    if n > max_bytes:
        raise CodecError("message too large")
    data = _read_exact(fd, n, deadline)
    try:
        msg = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CodecError("bad message: %s" % type(exc).__name__)
    if not isinstance(msg, dict):
        raise CodecError("bad message")
    return msg
