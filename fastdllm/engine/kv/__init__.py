"""The decode K/V and its one owner: pages (`pages`), stored prompts (`prefix`), the runner that
holds both for a model (`runner`), and a decode's rows over them (`rows`)."""

from .runner import KVRunner, runner_for

__all__ = ["KVRunner", "runner_for"]
