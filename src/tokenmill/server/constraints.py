"""A request's output constraint: what the engine enforces, and how the server re-checks it.

The engine enforces the constraint token by token (a grammar inside the decoding loop), so
an output that ends with finish_reason "stop" is complete under the grammar. The server
re-checks each such output with an independent implementation (the `jsonschema` library
for JSON schemas, Python's `re` for regexes) and counts disagreements in
`tokenmill:structured_output_invalid_total`: a counter that should stay at zero, and whose
movement points at a grammar-engine bug or a schema keyword the two read differently.
Outputs cut by `max_tokens` ("length") are incomplete by definition and are not checked.

Where a constraint comes from:
    response_format {"type": "json_schema"}      -> json (its `schema`)
    response_format {"type": "json_object"}      -> json_object
    structured_outputs {json|json_object|regex|choice|grammar}   (vLLM's extra body)
    tool_choice "required" or a named function   -> tool_call (built in tool_calls.py)
At most one of them per request; two at once is a 400, since only one can be enforced.
A grammar (Lark or GBNF) has no independent checker here, so grammar outputs are not
re-checked.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from tokenmill.engine.logits.processor import LogitsProcessorSpec
from tokenmill.engine.structured_output.spec import StructuredOutputsParams
from tokenmill.server.errors import APIError, invalid
from tokenmill.server.protocol import SamplingFields

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    # The metrics label: params.kind, or "tool_call" (metrics.STRUCTURED_OUTPUT_KINDS).
    kind: str
    # The compiled re-checker for json kinds, built once per request.
    _validator: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, params: StructuredOutputsParams, kind: str | None = None, *, param: str | None = None) -> Constraint:
        """`param` names the field a bad JSON schema is reported under."""
        validator = None
        if params.kind == "json" and isinstance(params.json, dict):
            validator = json_schema_validator(params.json, param)
        return cls(params, kind or params.kind, validator)

    def holds(self, text: str) -> bool:
        """Whether a complete output satisfies the constraint (True when it cannot be checked)."""
        kind = self.params.kind
        if kind in ("json", "json_object"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return False
            if kind == "json_object":
                return isinstance(value, dict)
            return self._validator is None or bool(self._validator.is_valid(value))
        if kind == "choice":
            return text in (self.params.choice or ())
        if kind == "regex":
            assert self.params.regex is not None
            try:
                pattern = re.compile(self.params.regex)
            except re.error:
                return True  # a regex dialect Python's re cannot read: not checkable here
            return pattern.fullmatch(text) is not None
        return True


def json_schema_validator(schema: dict[str, Any], param: str | None) -> Any:
    """A jsonschema validator for `schema` (its `$schema` dialect, else draft 2020-12), with
    format checks; a schema that is not valid JSON Schema is a 400."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise invalid(f"not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}", param) from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def output_constraint(body: SamplingFields) -> Constraint | None:
    """The constraint `response_format` or `structured_outputs` asks for; None for free text."""
    response_format = body.response_format
    kind = "text" if response_format is None else response_format.type
    if response_format is not None:
        if kind == "json_schema" and response_format.json_schema is None:
            raise APIError(
                400,
                "Missing required parameter: 'response_format.json_schema'",
                param="response_format.json_schema",
                code="missing_required_parameter",
            )
        if kind != "json_schema" and response_format.json_schema is not None:
            raise invalid(f"'json_schema' goes with type 'json_schema', not {kind!r}", "response_format.json_schema")
    if kind != "text" and body.structured_outputs is not None:
        raise invalid(
            "give at most one of 'response_format' and 'structured_outputs': only one constraint "
            "can be enforced",
            "structured_outputs",
        )
    if kind == "json_schema":
        assert response_format is not None and response_format.json_schema is not None
        schema = response_format.json_schema.schema_
        return Constraint.of(StructuredOutputsParams(json=schema), param="response_format.json_schema.schema")
    if kind == "json_object":
        return Constraint.of(StructuredOutputsParams(json_object=True))
    raw = body.structured_outputs
    if raw is None:
        return None
    try:
        params = StructuredOutputsParams(
            json=raw.json_,
            json_object=bool(raw.json_object),
            regex=raw.regex,
            choice=None if raw.choice is None else tuple(raw.choice),
            grammar=raw.grammar,
        )
    except ValueError as exc:
        message = str(exc)
        # The spec's messages name the field ("structured_outputs.choice must ...").
        named = re.match(r"structured_outputs\.(\w+)", message)
        raise invalid(message, named.group(0) if named else "structured_outputs") from None
    return Constraint.of(params, param="structured_outputs.json")


def logits_processor_specs(body: SamplingFields) -> list[LogitsProcessorSpec]:
    """`logits_processors`: names or {"name", "args"}; the engine checks names and args."""
    specs = []
    seen: set[str] = set()
    for i, entry in enumerate(body.logits_processors or []):
        name, args = (entry, {}) if isinstance(entry, str) else (entry.name, dict(entry.args))
        if not name:
            raise invalid("a logits processor name must be non-empty", f"logits_processors[{i}]")
        if name in seen:
            raise invalid(f"logits processor {name!r} is listed twice", f"logits_processors[{i}]")
        seen.add(name)
        specs.append(LogitsProcessorSpec(name, args))
    return specs


async def prepare_engine(engine: Any, params: Any, body: Any) -> None:
    """Have the engine compile the request's grammar and check its logits processors now,
    before a stream starts, so a refusal is a 400 naming the field (streamed or not)."""
    try:
        await engine.prepare(params)
    except ValueError as exc:
        message = str(exc)
        if "logits processor" in message or "logits_processors" in message:
            param = "logits_processors"
        elif getattr(body, "structured_outputs", None) is not None:
            param = "structured_outputs"
        elif getattr(body, "tool_choice", None) not in (None, "none", "auto"):
            param = "tool_choice"
        else:
            param = "response_format"
        raise invalid(message, param) from None
