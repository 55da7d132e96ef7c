"""Code-eval verdicts that the solution cannot forge: attacks through the real HumanEval and MBPP
runners (`task.scorer`, hence `sandbox.judge`), each of which must never be scored "passed"."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from fastdllm.evaluation.tasks import get_task
from fastdllm.sandbox import CodeCheck, judge
from fastdllm.sandbox.judge import remote_names

from .conftest import sandbox_processes

# Module-level code the attacker runs before (or instead of) the tests; {name} is the function
# the tests call. Each is a complete solution.
ATTACKS = {
    "forged_verdict": """
import os, json
msg = json.dumps({{"passed": True, "reason": "", "solution_gone": False}}).encode() + b"\\n"
for fd in range(3, 256):
    try:
        os.write(fd, msg)
    except OSError:
        pass
for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
    for fd in range(3, 32):
        try:
            with open(f"/proc/{{pid}}/fd/{{fd}}", "wb") as f:
                f.write(msg)
        except OSError:
            pass
def {name}(*args, **kwargs):
    return None
""",
    "trace_jump": """
import sys
def tracer(frame, event, arg):
    if event == "line" and "assert" in (frame.f_code.co_name + str(frame.f_code.co_consts)):
        try:
            frame.f_lineno = frame.f_lineno + 1
        except ValueError:
            pass
    return tracer
sys.settrace(tracer)
def {name}(*args, **kwargs):
    sys.settrace(tracer)
    return None
""",
    "always_equal": """
import builtins, math
class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __bool__(self): return True
    def __abs__(self): return 0
    def __sub__(self, other): return AlwaysEqual()
    __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __sub__
    def __iter__(self): return iter([])
    def __len__(self): return 0
    def __hash__(self): return 0
    def __getitem__(self, i): return AlwaysEqual()
builtins.abs = lambda x: 0
math.isclose = lambda *a, **k: True
builtins.sorted = lambda *a, **k: AlwaysEqual()
def {name}(*args, **kwargs):
    return AlwaysEqual()
""",
    "exit_zero_first": "import sys\nsys.exit(0)\ndef {name}(*args, **kwargs):\n    return None\n",
    "os_exit_first": "import os\nos._exit(0)\ndef {name}(*args, **kwargs):\n    return None\n",
    "system_exit_in_call": "def {name}(*args, **kwargs):\n    raise SystemExit(0)\n",
    "os_exit_in_call": "import os\ndef {name}(*args, **kwargs):\n    os._exit(0)\n",
    "excepthook_and_atexit": """
import atexit, os, sys
sys.excepthook = lambda *a: os._exit(0)
atexit.register(lambda: os._exit(0))
def {name}(*args, **kwargs):
    raise AssertionError
""",
    "prints_a_pass": """
import sys
print('{{"passed": true, "reason": ""}}')
print("passed", file=sys.stderr)
def {name}(*args, **kwargs):
    print("All tests passed")
    return None
""",
    "kills_the_checker": """
import os, signal
def {name}(*args, **kwargs):
    for target in [os.getppid(), 1] + list(range(2, 400)):
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    return None
""",
    "answers_true_to_everything": """
import os
reply = b'{{"ok":["b",true]}}\\n'
for _ in range(64):
    try:
        os.write(4, reply)
    except OSError:
        pass
def {name}(*args, **kwargs):
    return True
""",
    "truthy_object": """
class Yes:
    def __bool__(self): return True
    def __eq__(self, other): return True
def {name}(*args, **kwargs):
    return Yes()
""",
}


def entry_name(task, doc) -> str:
    return task.build_check(doc, "").remote[0]


def solution_for(task_name: str, doc, attack: str) -> str:
    task = get_task(task_name)
    code = ATTACKS[attack].format(name=entry_name(task, doc))
    return f"```python\n{code}\n```" if task_name == "humaneval" else code


# A sample that includes tests of every shape: comparisons with literals, truth tests
# (HumanEval/0 asserts candidate(...) == True / == False), floats with a tolerance (HumanEval/2,
# MBPP/17), helpers from the prompt (HumanEval/32 poly, /38 encode_cyclic), setup trees (MBPP 367).
SAMPLE = {
    "humaneval": ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/38", "HumanEval/53"],
    "mbpp": ["mbpp/11", "mbpp/17", "mbpp/126", "mbpp/367", "mbpp/411"],
}


def sample_docs(task_name: str):
    docs = {d.id: d for d in get_task(task_name).load()}
    return [docs[i] for i in SAMPLE[task_name]]


def gold(task_name: str, doc) -> str:
    return doc.data.get("canonical_solution") or doc.data["code"]


leftover_processes = sandbox_processes


# Every attack on the first sampled problem of MBPP; on every problem of each task in the slow set.
@pytest.mark.parametrize(
    "task_name, problems",
    [
        pytest.param("humaneval", 1, marks=pytest.mark.slow),  # its every problem runs there too
        ("mbpp", 1),
        pytest.param("humaneval", None, marks=pytest.mark.slow),
        pytest.param("mbpp", None, marks=pytest.mark.slow),
    ],
)
def test_no_attack_is_ever_passed(task_name, problems, tmp_path):
    task = get_task(task_name)
    docs = sample_docs(task_name)[:problems]
    items = [(d, a) for a in ATTACKS for d in docs]
    # A file this process holds open for writing: an attack that reached the host's /proc/*/fd
    # (the forged verdict tries every fd of every process) would overwrite it.
    canary_path = tmp_path / "canary.log"
    with open(canary_path, "w") as canary:
        canary.write("untouched\n")
        canary.flush()
        with task.scorer(workers=2) as scorer:
            scores = scorer.score([d for d, _ in items], [solution_for(task_name, d, a) for d, a in items])
            controls = scorer.score(docs, [gold(task_name, d) for d in docs])  # the same docs can pass
    assert canary_path.read_text() == "untouched\n"
    passed = [(d.id, a) for (d, a), s in zip(items, scores) if s.correct or s.verdict == "passed"]
    assert passed == []
    assert [s.verdict for s in controls] == ["passed"] * len(docs), [(s.verdict, s.reason) for s in controls]
    time.sleep(0.2)
    assert leftover_processes() == []


@pytest.mark.slow
def test_verdict_reasons_say_what_happened():
    task = get_task("humaneval")
    doc = sample_docs("humaneval")[0]
    with task.scorer(workers=1, timeout=2.0) as scorer:
        crash, loop, raised, gone = scorer.score(
            [doc] * 4,
            [
                "```python\nimport sys\nclass A:\n    def __repr__(self):\n        return repr(self)\n"
                "def has_close_elements(n, t):\n    sys.setrecursionlimit(10**8)\n    return repr(A())\n```",
                "```python\ndef has_close_elements(n, t):\n    while True:\n        pass\n```",
                "    return 1 / 0\n",
                "    import os\n    os._exit(3)\n",
            ],
        )
    assert crash.verdict == "crashed" and "SIGSEGV" in crash.reason, crash
    assert loop.verdict == "timeout" and "CPU time" in loop.reason, loop
    assert raised.verdict == "failed" and "ZeroDivisionError" in raised.reason, raised
    assert gone.verdict == "failed" and "status 3" in gone.reason, gone


def test_values_cross_with_their_types():
    """Plain values keep their exact types; objects stay in the solution's process as handles
    that can be passed back but never compare equal to a value."""
    solution = """
import math
class Box:
    def __init__(self, v): self.v = v
def values():
    return [(1, 2), {1, 2}, frozenset({3}), {"a": [1.5]}, 2 ** 200, float("inf"), 1 + 2j, b"x", None, True]
def make(v): return Box(v)
def unbox(b): return b.v
def gen(): return (i * i for i in range(4))
def nan(): return float("nan")
"""
    tests = """
v = values()
assert v == [(1, 2), {1, 2}, frozenset({3}), {"a": [1.5]}, 2 ** 200, float("inf"), 1 + 2j, b"x", None, True]
assert [type(x).__name__ for x in v] == ["tuple", "set", "frozenset", "dict", "int", "float", "complex", "bytes",
                                         "NoneType", "bool"]
b = make(7)
assert b != 7 and unbox(b) == 7 and b.v == 7
try:
    bool(b)
    raise RuntimeError("a handle must not have a truth value")
except TypeError:
    pass
assert list(gen()) == [0, 1, 4, 9] and gen() != [0, 1, 4, 9]
x = nan()
assert x != x
"""
    r = judge(CodeCheck(solution, tests, remote=remote_names(tests, set())))
    assert r.verdict == "passed", r


def test_remote_names_keep_builtins_out_unless_the_reference_defines_them():
    tests = "assert sum(10, 15) == 6\nassert abs(f(1) - 2) < 1e-9\nx = 3\nassert g(x)"
    assert remote_names(tests, {"sum"}) == ("sum", "f", "g")
    assert remote_names(tests, set()) == ("f", "g")


@pytest.mark.slow
@pytest.mark.parametrize("task_name", ["humaneval", "mbpp"])
@pytest.mark.parametrize("attack", ["forged_verdict", "always_equal"])
def test_attack_fails_on_every_problem(task_name, attack):
    task = get_task(task_name)
    docs = task.load()
    with task.scorer(workers=2) as scorer:
        scores = scorer.score(docs, [solution_for(task_name, d, attack) for d in docs])
    passed = [d.id for d, s in zip(docs, scores) if s.verdict == "passed"]
    assert passed == []


def burners():
    code = "import time\nt = time.time() + 900\nwhile time.time() < t:\n    pass\n"
    import sys

    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]


@pytest.mark.slow
def test_mbpp_gold_passes_and_its_heaviest_on_a_loaded_machine():
    """Every MBPP reference solution passes; and the CPU limit decides timeouts: with a busy loop
    on every core, the solutions that took longest unloaded still pass (task 123's takes ~3.5 s of
    CPU): a wall-clock limit would fail those first."""
    task = get_task("mbpp")
    docs = task.load()
    with task.scorer(workers=2) as scorer:
        scores = scorer.score(docs, [d.data["code"] for d in docs])
    assert [(d.id, s.verdict, s.reason) for d, s in zip(docs, scores) if not s.correct] == []
    took = {d.id: s.extra["duration"] for d, s in zip(docs, scores)}
    heaviest = sorted(docs, key=lambda d: took[d.id], reverse=True)[:16]
    procs = burners()
    try:
        with task.scorer(workers=2) as scorer:
            scores = scorer.score(heaviest, [d.data["code"] for d in heaviest])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    failed = [(d.id, s.verdict, s.reason, took[d.id]) for d, s in zip(heaviest, scores) if not s.correct]
    assert failed == [] and max(took.values()) > 1.0  # a solution heavy enough that load would tell


# ---- what passes under the benchmarks' own harness passes here ------------------------------------
STDLIB_VALUES = {
    "fraction": (
        "from fractions import Fraction\ndef f(): return Fraction(15, 2)",
        "from fractions import Fraction\nv = f()\nassert v == 7.5 and v == Fraction(15, 2) and type(v) is Fraction",
    ),
    "decimal": (
        "from decimal import Decimal\ndef f(): return Decimal('0.1') + Decimal('0.2')",
        "from decimal import Decimal\nv = f()\nassert v == Decimal('0.3') and type(v) is Decimal and str(v) == '0.3'",
    ),
    "complex": ("def f(): return complex(1, -2.5)", "assert f() == 1 - 2.5j"),
    "ordered_dict": (
        "from collections import OrderedDict\ndef f(): return OrderedDict([('b', 1), ('a', 2)])",
        "from collections import OrderedDict\nv = f()\nassert v == OrderedDict([('b', 1), ('a', 2)])"
        "\nassert v != OrderedDict([('a', 2), ('b', 1)]) and list(v) == ['b', 'a']",
    ),
    "defaultdict": (
        "from collections import defaultdict\ndef f():\n    d = defaultdict(list)\n    d['x'].append(1)\n    return d",
        "v = f()\nassert v == {'x': [1]} and v['y'] == [] and type(v).__name__ == 'defaultdict'",
    ),
    "counter": (
        "from collections import Counter\ndef f(): return Counter('abca')",
        "from collections import Counter\nv = f()\nassert v == Counter({'a': 2, 'b': 1, 'c': 1}) "
        "and v.most_common(1) == [('a', 2)] and v['z'] == 0",
    ),
    "deque": (
        "from collections import deque\ndef f(): return deque([1, 2, 3], maxlen=3)",
        "from collections import deque\nv = f()\nassert v == deque([1, 2, 3]) and v.maxlen == 3",
    ),
    "named_tuple": (
        "from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f(): return P(1, 2)",
        "assert f() == (1, 2)",
    ),
    "datetime": (
        "import datetime as dt\ndef f(): return dt.datetime(2024, 2, 29, 13, 5, 7, 12, "
        "tzinfo=dt.timezone(dt.timedelta(hours=-3)))",
        "import datetime as dt\nv = f()\nassert v == dt.datetime(2024, 2, 29, 16, 5, 7, 12, "
        "tzinfo=dt.timezone.utc) and v.utcoffset() == dt.timedelta(hours=-3)",
    ),
    "date": (
        "import datetime as dt\ndef f(): return dt.date(1999, 12, 31)",
        "import datetime as dt\nassert f() == dt.date(1999, 12, 31) and type(f()) is dt.date",
    ),
    "time": (
        "import datetime as dt\ndef f(): return dt.time(23, 59, 1, 5)",
        "import datetime as dt\nassert f() == dt.time(23, 59, 1, 5)",
    ),
    "timedelta": (
        "import datetime as dt\ndef f(): return dt.timedelta(days=-1, seconds=5, microseconds=3)",
        "import datetime as dt\nassert f() == dt.timedelta(days=-1, seconds=5, microseconds=3)",
    ),
    "range": ("def f(): return range(2, 11, 3)", "assert f() == range(2, 11, 3) and list(f()) == [2, 5, 8, 11][:3]"),
}


# a value of each kind in the default suite (a tuple subclass, a tz-aware datetime, a dict subclass,
# a lazy sequence); every value in the slow set
EVERY_RUN = {"named_tuple", "datetime", "counter", "range"}


@pytest.mark.parametrize(
    "name", [n if n in EVERY_RUN else pytest.param(n, marks=pytest.mark.slow) for n in STDLIB_VALUES]
)
def test_standard_library_values_cross_as_themselves(name):
    solution, tests = STDLIB_VALUES[name]
    r = judge(CodeCheck(solution, tests, remote=("f",)))
    assert r.verdict == "passed", r
    # equal values are equal (a stand-in that is never equal would pass this and fail the above)
    wrong = judge(CodeCheck(solution, tests + "\nassert f() != f()", remote=("f",)))
    assert wrong.verdict == "failed", wrong


def test_humaneval_45_with_a_fraction_passes():
    task = get_task("humaneval")
    doc = next(d for d in task.load() if d.id.endswith("/45"))
    with task.scorer(workers=1) as scorer:
        (score,) = scorer.score([doc], ["    from fractions import Fraction\n    return Fraction(a) * h / 2\n"])
    assert score.verdict == "passed", score


def test_an_oversize_reply_is_the_solution_gone_not_an_exception_the_tests_can_swallow():
    solution = "def f(): return 'x' * (40 * 1024 * 1024)"
    tests = "try:\n    f()\nexcept Exception:\n    pass\n"
    r = judge(CodeCheck(solution, tests, remote=("f",)))
    assert r.verdict != "passed" and "message too large" in r.reason, r


def test_a_reply_naming_a_global_is_malformed():
    solution = "import wire\ndef f(): return wire.GlobalRef('f')"
    r = judge(CodeCheck(solution, "assert f()", remote=("f",)))
    assert r.verdict != "passed" and "malformed reply" in r.reason, r


@pytest.mark.parametrize(
    "solution",
    [
        pytest.param("def f(x): return 1\nraise SystemExit(3)", marks=pytest.mark.slow),  # exits before answering
        pytest.param("import os\ndef f(x):\n    os._exit(5)", marks=pytest.mark.slow),  # exits in the call
        pytest.param(  # a call that raises
            "def f(x):\n    import sys\n    sys.stdout.flush()\n    raise KeyboardInterrupt", marks=pytest.mark.slow
        ),
        "def f(x) return 1",  # does not compile
    ],
)
def test_the_same_answer_gets_the_same_verdict_and_reason_every_run(solution):
    tests = "assert f(1) == 1\nassert f(2) == 1\n"
    seen = {(r.verdict, r.reason) for r in (judge(CodeCheck(solution, tests, remote=("f",))) for _ in range(6))}
    assert len(seen) == 1 and next(iter(seen))[0] in ("failed", "crashed"), seen
