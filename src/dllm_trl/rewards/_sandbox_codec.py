"""Data-only codec and message framing shared by the code-reward judge and executor.

Standalone (stdlib only, no package imports): the source of this file is prepended to the judge and
executor programs that :mod:`dllm_trl.rewards.code` runs with ``python -I -S -c``.

Values cross the process boundary as tagged JSON, and the *decoder* (which runs in the trusted
judge) can only ever build plain builtin objects: ``None``, ``bool``, ``int``, ``float``,
``complex``, ``str``, ``bytes``, ``bytearray``, ``list``, ``tuple``, ``set``, ``frozenset``,
``dict``, ``range``, ``collections.deque`` and a ``list_iterator`` (for generators / map / filter /
zip / other iterators, exhausted in the executor). Whatever the candidate does to its own process,
the judge therefore compares plain values with builtin ``==``; an object whose ``__eq__`` always
returns True cannot be transported at all.

Framing: 4-byte big-endian length, then UTF-8 JSON. Messages larger than the receiver's limit are
a protocol error.
"""

import base64
import json
import math
import os
import select
import struct
import time

MAX_DEPTH = 200


class CodecError(Exception):
    pass


class ChannelClosed(Exception):
    pass


class ChannelTimeout(Exception):
    pass


def encode_value(obj, _depth=0):
    """Builtin value -> JSON-compatible tagged structure. Subclasses of builtin types are coerced to
    the builtin base (their overridden methods do not travel). Anything else raises TypeError."""
    if _depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = _depth + 1
    t = type(obj)
    if obj is None or obj is True or obj is False:
        return obj
    if isinstance(obj, bool):  # bool subclass cannot exist, kept for clarity
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
        return {"c": [encode_value(float(v.real), d), encode_value(float(v.imag), d)]}
    if isinstance(obj, str):
        return obj if t is str else str.__str__(obj)
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, bytearray):
        return {"ba": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, tuple):
        return {"t": [encode_value(x, d) for x in tuple.__iter__(obj)]}
    if isinstance(obj, list):
        return {"l": [encode_value(x, d) for x in list.__iter__(obj)]}
    if isinstance(obj, frozenset):
        return {"fs": [encode_value(x, d) for x in frozenset.__iter__(obj)]}
    if isinstance(obj, set):
        return {"s": [encode_value(x, d) for x in set.__iter__(obj)]}
    if isinstance(obj, dict):
        return {"d": [[encode_value(k, d), encode_value(v, d)] for k, v in dict.items(obj)]}
    if t is range:
        return {"r": [obj.start, obj.stop, obj.step]}
    mod = getattr(t, "__module__", "")
    if t.__name__ == "deque" and mod == "collections":
        return {"dq": [encode_value(x, d) for x in list(obj)]}
    if mod == "builtins" and hasattr(t, "__next__"):
        # generator, map, filter, zip, enumerate, reversed, list_iterator, ...
        return {"it": [encode_value(x, d) for x in obj]}
    if t.__name__ in ("dict_keys", "dict_values", "dict_items") and mod == "builtins":
        return {"l": [encode_value(x, d) for x in obj]}
    raise TypeError("cannot transport a value of type %s" % t.__name__)


def _need(cond):
    if not cond:
        raise CodecError("malformed value")


def decode_value(obj, _depth=0):
    """Tagged structure (from untrusted JSON) -> plain builtin value. Raises CodecError."""
    if _depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    d = _depth + 1
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
            re_, im = decode_value(v[0], d), decode_value(v[1], d)
            _need(type(re_) is float and type(im) is float)
            return complex(re_, im)
        if tag in ("b", "ba"):
            _need(isinstance(v, str))
            raw = base64.b64decode(v.encode("ascii"), validate=True)
            return raw if tag == "b" else bytearray(raw)
        if tag == "r":
            _need(isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v))
            return range(v[0], v[1], v[2])
        _need(isinstance(v, list))
        if tag == "t":
            return tuple(decode_value(x, d) for x in v)
        if tag == "l":
            return [decode_value(x, d) for x in v]
        if tag == "s":
            return set(decode_value(x, d) for x in v)
        if tag == "fs":
            return frozenset(decode_value(x, d) for x in v)
        if tag == "d":
            out = {}
            for kv in v:
                _need(isinstance(kv, list) and len(kv) == 2)
                out[decode_value(kv[0], d)] = decode_value(kv[1], d)
            return out
        if tag == "dq":
            import collections

            return collections.deque(decode_value(x, d) for x in v)
        if tag == "it":
            return iter([decode_value(x, d) for x in v])
    except CodecError:
        raise
    except (TypeError, ValueError, RecursionError, OverflowError, MemoryError) as exc:
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
