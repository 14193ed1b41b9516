"""Priority classes: which class a request is in, and what that class may use.

A tenant may pin its class; otherwise the request's `x-tokenmill-priority` header names
one; otherwise the default class. Classes are ordered by `engine_priority` (lower first):
that order decides who gets a freed slot first and who is shed first (the last class).
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenmill.gateway.config import PrioritiesConfig, PriorityClass
from tokenmill.gateway.errors import GatewayError


class Priorities:
    def __init__(self, config: PrioritiesConfig) -> None:
        self.classes: dict[str, PriorityClass] = dict(config.classes)
        self.default = config.default
        self.header = config.header.lower()
        # Best first.
        self.order = sorted(self.classes, key=lambda c: (self.classes[c].engine_priority, c))

    def resolve(self, pinned: str | None, headers: Mapping[str, str]) -> str:
        if pinned is not None:
            return pinned
        asked = headers.get(self.header)
        if asked is None:
            return self.default
        if asked not in self.classes:
            raise GatewayError(400, f"unknown priority class {asked!r}; classes are {self.order}", param=self.header)
        return asked

    def __getitem__(self, name: str) -> PriorityClass:
        return self.classes[name]
