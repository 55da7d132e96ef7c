"""The solution's process of a judged program: `python -I -B solution_side.py REQ_FD RESP_FD`.

Runs the untrusted solution (`solution.py`), then the task's setup code (`setup.py`, which may
use the solution's classes), then answers the tests' requests one line at a time: call a global
or a handle with arguments, or read an attribute of a handle. Results go back as data
(`wire.encode`); anything that is not plain data stays here and goes back as a handle.

Nothing here is trusted: the solution can replace any of it. What it can send is only data,
which the tests' process decodes into plain values (see `wire`).
"""

import builtins
import os
import site
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Started with -S (no .pth processing, which can cost tens of ms): site-packages still importable.
sys.path.extend(p for p in site.getsitepackages() if p not in sys.path)
import wire  # noqa: E402


def main():
    req_fd, resp_fd = int(sys.argv[1]), int(sys.argv[2])
    ns = {"__name__": "__main__", "__builtins__": builtins}
    for name in ("solution.py", "setup.py"):
        with open(name, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, name, "exec"), ns)  # noqa: S102 - this process is the sandboxed one
    handles = []
    reader = wire.LineReader(req_fd)

    def resolve(tree):
        return wire.decode(tree, make_handle=handles.__getitem__, make_global=lambda n: ns[n])

    while True:
        line = reader.read()
        if line is None:
            return
        try:
            msg = wire.loads(line)
            target = resolve(msg["target"])
            if msg["op"] == "call":
                result = target(*resolve(msg["args"]), **resolve(msg["kwargs"]))
            else:
                result = getattr(target, msg["name"])
            reply = {"ok": wire.encode(result, handles)}
        except BaseException as e:  # noqa: BLE001 - a SystemExit in a call is a failed call
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        wire.write_all(resp_fd, wire.dumps(reply))


main()
