"""Logits processors by name: the `tokenmill.logits_processors` entry-point group.

A package adds a processor by declaring, in its pyproject.toml,

    [project.entry-points."tokenmill.logits_processors"]
    my_rule = "my_package.rules:MyRule"

The engine constructs each registered class once, as `cls(context)`, and a request enables
it by name (`logits_processors: [{"name": "my_rule", "args": {...}}]`). A class may define
`validate_args(args, context)` (a classmethod raising ValueError) so bad arguments fail the request
before it is accepted. tokenmill's own examples are registered the same way.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "tokenmill.logits_processors"

logger = logging.getLogger(__name__)


def registered_processors() -> dict[str, type[Any]]:
    """name -> class of every processor installed in the entry-point group."""
    classes: dict[str, type[Any]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not take the engine down
            logger.error("logits processor %r (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if not callable(getattr(cls, "apply", None)) or not callable(getattr(cls, "update_state", None)):
            logger.error("logits processor %r (%s) lacks apply/update_state: skipped", ep.name, ep.value)
            continue
        classes[ep.name] = cls
    return classes
