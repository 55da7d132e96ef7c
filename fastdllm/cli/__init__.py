"""The commands of `fastdllm <command>`: one module each, with `main(argv)`.

Only the dispatcher (`fastdllm/cli/main.py`) imports them; they import the library (generation,
evaluation, server, training) and the shared flags (`fastdllm/cli/args.py`), never each other.
"""
