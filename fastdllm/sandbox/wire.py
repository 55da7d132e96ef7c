"""Values as data: how arguments and return values cross between the judge's two processes.

A value is encoded as JSON, every node a list `[tag, payload...]`, so that the decoder can build
nothing but plain values of the built-in types (None, bool, int, float, complex, str, bytes,
bytearray, list, tuple, set, frozenset, dict, range, and a list iterator for a returned generator
or map) and the standard library's value types that benchmark code returns and compares:
`fractions.Fraction`, `decimal.Decimal`, `collections` (OrderedDict, defaultdict with a built-in
factory, Counter, deque), and `datetime` (date, time, datetime, timedelta; a time zone arrives as
its fixed offset). Types are kept exactly (a tuple stays a tuple, 1 and 1.0 and True stay apart,
float bits are exact through `float.hex`, ints of any size through hex); a named tuple arrives as
a plain tuple, which compares as the original would with a tuple. So what passes under the
benchmarks' own harness passes here, and what fails there fails here.

Two tags name things that stay in the solution's process: `["h", n]` (a handle to an object
that is not plain data, e.g. an instance of the solution's class) and `["g", name]` (one of the
solution's globals). The test side turns a handle into a `Handle`, which can be passed back as
an argument and compared by identity only: it is never equal to a value, has no truth value and
cannot be iterated, so an object with a forged `__eq__`, `__bool__` or `__iter__` cannot pass a
test.

This file is copied into both sandboxed processes and imports only the standard library.
The decoder is the trust boundary: it checks every tag and payload type and raises `WireError`
on anything else.
"""

from __future__ import annotations

import base64
import collections
import datetime
import decimal
import fractions
import json

MAX_MESSAGE_BYTES = 32 * 1024 * 1024


class WireError(Exception):
    """A message that is not a well-formed encoded value."""


# defaultdict factories that cross by name (any other factory arrives as None)
_FACTORIES = {f.__name__: f for f in (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset)}


# ---- encoding (either side; the solution's side is not trusted, so nothing relies on it) --------
def encode(value, handles=None):
    """`value` as a JSON-able tree. Objects that are not plain data become handles stored in
    `handles` (a list: the handle is the index), or raise WireError when `handles` is None."""
    return _enc(value, handles, 0)


def _enc(v, handles, depth):
    if depth > 200:
        raise WireError("value nested too deeply")
    d = depth + 1
    if v is None:
        return ["n"]
    if v is True or v is False:
        return ["b", bool(v)]
    if isinstance(v, Handle):
        return ["h", v.id]
    if isinstance(v, GlobalRef):
        return ["g", v.name]
    if isinstance(v, int) and not isinstance(v, bool):
        return ["i", hex(int.__index__(v))]
    if isinstance(v, float):
        return ["f", float.hex(float(v))]
    if isinstance(v, complex):
        c = complex(v)
        return ["c", float.hex(c.real), float.hex(c.imag)]
    if isinstance(v, str):
        return ["s", str.__str__(v)]
    if isinstance(v, (bytes, bytearray)):
        return ["y", base64.b64encode(bytes(v)).decode("ascii"), isinstance(v, bytearray)]
    if isinstance(v, fractions.Fraction):
        return ["Q", hex(int.__index__(v.numerator)), hex(int.__index__(v.denominator))]
    if isinstance(v, decimal.Decimal):
        return ["D", decimal.Decimal.__str__(v)]
    if isinstance(v, datetime.datetime):
        return ["dT", datetime.datetime.isoformat(v), v.fold]
    if isinstance(v, datetime.date):
        return ["da", datetime.date.isoformat(v)]
    if isinstance(v, datetime.time):
        return ["tm", datetime.time.isoformat(v), v.fold]
    if isinstance(v, datetime.timedelta):
        return ["td", v.days, v.seconds, v.microseconds]
    if isinstance(v, range):
        return ["r", hex(v.start), hex(v.stop), hex(v.step)]
    if isinstance(v, tuple):
        return ["t", [_enc(x, handles, d) for x in tuple.__iter__(v)]]
    if isinstance(v, list):
        return ["l", [_enc(x, handles, d) for x in list.__iter__(v)]]
    if isinstance(v, frozenset):
        return ["F", [_enc(x, handles, d) for x in frozenset.__iter__(v)]]
    if isinstance(v, set):
        return ["S", [_enc(x, handles, d) for x in set.__iter__(v)]]
    if isinstance(v, collections.deque):
        return ["dq", [_enc(x, handles, d) for x in collections.deque.__iter__(v)], v.maxlen]
    if isinstance(v, dict):
        pairs = [[_enc(k, handles, d), _enc(x, handles, d)] for k, x in dict.items(v)]
        if isinstance(v, collections.Counter):
            return ["C", pairs]
        if isinstance(v, collections.OrderedDict):
            return ["od", pairs]
        if isinstance(v, collections.defaultdict):
            factory = v.default_factory
            name = factory.__name__ if any(factory is f for f in _FACTORIES.values()) else None
            return ["dd", pairs, name]
        return ["d", pairs]
    item = getattr(type(v), "item", None)  # numpy scalars: their Python value
    if callable(item) and getattr(type(v), "__module__", "") == "numpy":
        return _enc(item(v), handles, d)
    if hasattr(type(v), "__next__") and hasattr(type(v), "__iter__"):  # generator, map, zip...
        return ["it", [_enc(x, handles, d) for x in v]]
    if handles is None:
        raise WireError(f"{type(v).__name__} is not plain data")
    handles.append(v)
    return ["h", len(handles) - 1]


def dumps(tree) -> bytes:
    return json.dumps(tree, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"


# ---- decoding (the trust boundary) ---------------------------------------------------------------
class Handle:
    """An object that lives in the solution's process. Identity is all it has: it is equal only
    to itself, hashable by identity, and refuses truth testing, iteration and arithmetic."""

    __slots__ = ("id", "_remote")

    def __init__(self, id_, remote=None):
        self.id, self._remote = id_, remote

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError("an object of the solution's (not plain data) has no truth value in the tests")

    def __iter__(self):
        raise TypeError("an object of the solution's (not plain data) cannot be iterated in the tests")

    def __len__(self):
        raise TypeError("an object of the solution's (not plain data) has no length in the tests")

    def __call__(self, *args, **kwargs):
        if self._remote is None:
            raise TypeError("not callable")
        return self._remote.call(["h", self.id], args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or self._remote is None:
            raise AttributeError(name)
        return self._remote.getattr(["h", self.id], name)

    def __repr__(self):
        return f"<solution object #{self.id}>"


class GlobalRef:
    """A name to look up among the solution's globals (test side: an argument such as `root`)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _need(cond, what):
    if not cond:
        raise WireError(what)


def decode(tree, make_handle=Handle, make_global=GlobalRef):
    """The value a tree stands for, built from built-in types only (handles by `make_handle`,
    globals by `make_global`)."""
    return _dec(tree, (make_handle, make_global), 0)


def _items(payload, make_handle, depth):
    _need(type(payload) is list, "container payload must be a list")
    return [_dec(x, make_handle, depth + 1) for x in payload]


def _dec(t, mh, depth):
    """One tagged node back into a value, checked as it is read (the bytes come from an untrusted
    process). Long on purpose: one branch per tag, each with its own checks, so that what the
    wire accepts is one readable list."""
    _need(depth <= 200, "value nested too deeply")
    _need(type(t) is list and len(t) >= 1 and type(t[0]) is str, "malformed node")
    tag, rest = t[0], t[1:]
    if tag == "n":
        return None
    if tag == "b":
        _need(len(rest) == 1 and type(rest[0]) is bool, "bad bool")
        return bool(rest[0])
    if tag == "i":
        _need(len(rest) == 1 and type(rest[0]) is str, "bad int")
        try:
            return int(rest[0], 16)
        except ValueError:
            raise WireError("bad int") from None
    if tag == "f":
        _need(len(rest) == 1 and type(rest[0]) is str, "bad float")
        try:
            return float.fromhex(rest[0])
        except (ValueError, OverflowError):
            raise WireError("bad float") from None
    if tag == "c":
        _need(len(rest) == 2 and all(type(x) is str for x in rest), "bad complex")
        try:
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        except (ValueError, OverflowError):
            raise WireError("bad complex") from None
    if tag == "s":
        _need(len(rest) == 1 and type(rest[0]) is str, "bad str")
        return str(rest[0])
    if tag == "y":
        _need(len(rest) == 2 and type(rest[0]) is str and type(rest[1]) is bool, "bad bytes")
        try:
            raw = base64.b64decode(rest[0].encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise WireError("bad bytes") from None
        return bytearray(raw) if rest[1] else bytes(raw)
    if tag in ("l", "t", "S", "F", "it"):
        _need(len(rest) == 1, "bad container")
        items = _items(rest[0], mh, depth)
        try:
            return {"l": list, "t": tuple, "S": set, "F": frozenset, "it": lambda xs: iter(list(xs))}[tag](items)
        except TypeError:
            raise WireError("unhashable set member") from None
    if tag in ("d", "od", "C", "dd"):
        _need(len(rest) == (2 if tag == "dd" else 1) and type(rest[0]) is list, "bad dict")
        if tag == "dd":
            _need(rest[1] is None or rest[1] in _FACTORIES, "bad defaultdict factory")
            out = collections.defaultdict(None if rest[1] is None else _FACTORIES[rest[1]])
        else:
            out = {"d": dict, "od": collections.OrderedDict, "C": collections.Counter}[tag]()
        for pair in rest[0]:
            _need(type(pair) is list and len(pair) == 2, "bad dict item")
            k = _dec(pair[0], mh, depth + 1)
            try:
                out[k] = _dec(pair[1], mh, depth + 1)
            except TypeError:
                raise WireError("unhashable dict key") from None
        return out
    if tag == "dq":
        _need(len(rest) == 2 and (rest[1] is None or (type(rest[1]) is int and rest[1] >= 0)), "bad deque")
        return collections.deque(_items(rest[0], mh, depth), rest[1])
    if tag in ("Q", "r"):
        _need(len(rest) == (2 if tag == "Q" else 3) and all(type(x) is str for x in rest), "bad number")
        try:
            parts = [int(x, 16) for x in rest]
            return fractions.Fraction(*parts) if tag == "Q" else range(*parts)
        except (ValueError, ZeroDivisionError):
            raise WireError("bad number") from None
    if tag == "D":
        _need(len(rest) == 1 and type(rest[0]) is str and len(rest[0]) <= 10_000, "bad decimal")
        try:
            return decimal.Decimal(rest[0])
        except (decimal.InvalidOperation, ValueError):
            raise WireError("bad decimal") from None
    if tag in ("dT", "da", "tm"):
        _need(len(rest) == (1 if tag == "da" else 2) and type(rest[0]) is str and len(rest[0]) <= 64, "bad date")
        cls = {"dT": datetime.datetime, "da": datetime.date, "tm": datetime.time}[tag]
        try:
            value = cls.fromisoformat(rest[0])
            return value if tag == "da" else value.replace(fold=rest[1])
        except (ValueError, TypeError):
            raise WireError("bad date") from None
    if tag == "td":
        _need(len(rest) == 3 and all(type(x) is int for x in rest), "bad timedelta")
        try:
            return datetime.timedelta(days=rest[0], seconds=rest[1], microseconds=rest[2])
        except OverflowError:
            raise WireError("bad timedelta") from None
    if tag == "h":
        _need(len(rest) == 1 and type(rest[0]) is int, "bad handle")
        return mh[0](rest[0])
    if tag == "g":
        _need(len(rest) == 1 and type(rest[0]) is str, "bad global")
        return mh[1](rest[0])
    raise WireError(f"unknown tag {tag!r}")


def loads(line: bytes):
    """A JSON message (one line) as a Python tree; WireError if it is not JSON."""
    _need(len(line) <= MAX_MESSAGE_BYTES, "message too large")
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise WireError("message is not JSON") from None


class LineReader:
    """Newline-terminated messages from a file descriptor, each bounded in size."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, bytearray()

    def read(self) -> bytes | None:
        """The next message (None at end of file)."""
        import os

        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[: end + 1])
                del self.buf[: end + 1]
                return line
            if len(self.buf) > MAX_MESSAGE_BYTES:
                raise WireError("message too large")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk


def write_all(fd: int, data: bytes) -> None:
    import os

    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
