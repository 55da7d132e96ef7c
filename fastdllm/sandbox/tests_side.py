"""The tests' process of a judged program: `python -I -B tests_side.py REQ_FD RESP_FD VERDICT_FD`.

Runs only trusted code: the task's prelude (`prelude.py`, e.g. HumanEval's prompt with its
helpers), then its tests (`tests.py`), with every name in `remote.json` bound to a stand-in that
forwards calls to the solution's process and decodes the answer into a plain value. The tests
decide; the verdict goes to VERDICT_FD, a pipe that only this process holds.

A solution that raises, exits, crashes, hangs or answers garbage makes the call raise
`SolutionFailed` (a BaseException, so a test's `except Exception` does not swallow it); once the
solution's process has stopped answering, no verdict can be "passed".
"""

import builtins
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wire  # noqa: E402


class SolutionFailed(BaseException):
    """A call into the solution did not return a value."""


def _no_global(name):
    """A reply names one of the solution's globals: no value the tests may see (it would be a
    truthy stand-in), so the reply is malformed."""
    raise wire.WireError(f"a reply may not name the solution's global {str(name)[:50]!r}")


class Remote:
    def __init__(self, req_fd, resp_fd):
        self.req_fd, self.reader = req_fd, wire.LineReader(resp_fd)
        self.gone = None  # why no more calls can be made (it stopped answering, or sent garbage)
        self.stopped = False  # its process stopped answering

    def _request(self, msg):
        if self.gone:
            raise SolutionFailed(self.gone)
        try:
            wire.write_all(self.req_fd, wire.dumps(msg))
            line = self.reader.read()
            if line is None:
                self.gone, self.stopped = "the solution's process stopped answering", True
                raise SolutionFailed(self.gone)
            reply = wire.loads(line)
            if type(reply) is dict and "error" in reply:
                raise SolutionFailed(f"the solution raised {str(reply['error'])[:300]}")
            if type(reply) is not dict or "ok" not in reply:
                raise wire.WireError("reply without a value")
            return wire.decode(reply["ok"], make_handle=lambda i: wire.Handle(i, self), make_global=_no_global)
        except OSError:
            self.gone, self.stopped = "the solution's process stopped answering", True
            raise SolutionFailed(self.gone) from None
        except wire.WireError as e:
            self.gone = f"the solution's process sent a malformed reply ({e})"
            raise SolutionFailed(self.gone) from None

    def call(self, target, args, kwargs):
        try:
            payload = {"args": wire.encode(list(args)), "kwargs": wire.encode(dict(kwargs))}
        except wire.WireError as e:
            raise TypeError(f"argument cannot be sent to the solution: {e}") from None
        return self._request({"op": "call", "target": target, **payload})

    def getattr(self, target, name):
        return self._request({"op": "getattr", "target": target, "name": str(name)})


class RemoteName(wire.GlobalRef):
    """Stands in for one of the solution's globals: calling it calls the solution's."""

    __slots__ = ("_remote",)

    def __init__(self, remote, name):
        super().__init__(name)
        self._remote = remote

    def __call__(self, *args, **kwargs):
        return self._remote.call(["g", self.name], args, kwargs)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._remote.getattr(["g", self.name], attr)

    def __repr__(self):
        return f"<solution's {self.name}>"


def _last_line(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    return (lines[-1].strip() if lines else type(exc).__name__)[:300]


def main():
    req_fd, resp_fd, verdict_fd = (int(a) for a in sys.argv[1:4])
    remote = Remote(req_fd, resp_fd)
    with open("remote.json", encoding="utf-8") as f:
        names = json.load(f)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    outcome = {"passed": False, "reason": ""}
    try:
        with open("prelude.py", encoding="utf-8") as f:
            exec(compile(f.read(), "prelude.py", "exec"), ns)  # noqa: S102 - trusted task code
        for name in names:
            ns[name] = RemoteName(remote, name)
        with open("tests.py", encoding="utf-8") as f:
            exec(compile(f.read(), "tests.py", "exec"), ns)  # noqa: S102 - trusted task code
        outcome = {"passed": remote.gone is None, "reason": remote.gone or ""}
    except SolutionFailed as e:
        outcome["reason"] = str(e)
    except BaseException as e:  # noqa: BLE001 - any failure of the tests is the verdict
        outcome["reason"] = _last_line(e)
    outcome["solution_gone"] = remote.stopped
    os.close(req_fd)
    wire.write_all(verdict_fd, json.dumps(outcome).encode() + b"\n")


main()
