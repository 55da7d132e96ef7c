"""The policy classes that configs name, one registry per kind. Each class registers itself where
it is defined (`CACHE_POLICIES.register` as a class decorator, `cache.register_cache_policy`
and the like for a user's policy), and its name joins the names a config accepts
(`config.CACHE_POLICIES`, ...). The built-in classes are all registered once `engine.policies`,
which builds a config's policies, is imported."""

from __future__ import annotations

from .. import config


class Registry:
    """Name -> class for one kind of policy, its names kept in `names` (the config's)."""

    def __init__(self, names: config.Names):
        self.names, self.kind = names, names.kind
        self.classes: dict[str, type] = {}

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def register(self, cls: type) -> type:
        """Make `cls` the class that configs name by `cls.name` (usable as a class decorator)."""
        self.classes[cls.name] = cls
        self.names.add(cls.name)
        return cls

    def __getitem__(self, name: str) -> type:
        if name not in self.classes:
            if name in self.names:  # a built-in whose module is not imported yet
                raise LookupError(f"{self.kind} {name!r}: registered once fastdllm.engine.policies is imported")
            raise ValueError(f"{self.kind}: must be one of {', '.join(self.names)} (got {name!r})")
        return self.classes[name]


CACHE_POLICIES = Registry(config.CACHE_POLICIES)
REFRESH_RULES = Registry(config.REFRESH_RULES)
SELECTION_RULES = Registry(config.SELECTION_RULES)
PROPOSALS = Registry(config.PROPOSALS)
