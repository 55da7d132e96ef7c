"""`python -m fastdllm.sandbox [file.py]`: run a file (or stdin) in the sandbox, print the verdict."""

import json
import sys

from . import protections, run_program


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    source = open(args[0], encoding="utf-8").read() if args else sys.stdin.read()
    r = run_program(source)
    print(
        json.dumps(
            {**r.to_dict(), "protections": list(protections()), "stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:]},
            indent=2,
        )
    )
    return 0 if r.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
