"""The one codec: bytes to models and back.

Decoding never raises anything but :class:`DecodeError`, whose ``reason`` is a
stable, machine-readable code used for quarantine rows and metrics.
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from contracts.digest import MAX_DEPTH
from contracts.models import (
    CancelCommand,
    CancelRequest,
    OperationReceipt,
    QueryAnswer,
    QueryCommand,
    ReceiptMessage,
    RequestMessage,
    ServiceCommand,
    StartRequest,
    SubmitCommand,
)

DEFAULT_MAX_BYTES: Final = 256 * 1024

_UNKNOWN_TYPE: Final = frozenset({"union_tag_invalid", "union_tag_not_found"})


class DecodeError(ValueError):
    """A message that is not a valid contract. ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_command = TypeAdapter[Any](ServiceCommand)
_receipt = TypeAdapter[Any](ReceiptMessage)
_start = TypeAdapter(StartRequest)
_request = TypeAdapter[Any](RequestMessage)


def _decode(adapter: TypeAdapter[Any], body: bytes, max_bytes: int) -> Any:
    if len(body) > max_bytes:
        raise DecodeError("oversized", f"{len(body)} bytes > limit {max_bytes}")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError("not_utf8", str(exc)) from None
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        text = str(exc)
        if text.startswith(("depth limit exceeded", "number is infinity")):
            raise DecodeError("non_canonical_value", text) from None
        raise DecodeError("malformed_json", text) from None
    if not isinstance(raw, dict):
        raise DecodeError("schema", "top level must be a JSON object")
    if "type" not in raw or (isinstance(raw.get("receipt"), dict) and "type" not in raw["receipt"]):
        raise DecodeError("unknown_type", "no type: the version is refused, not guessed")
    # Each walk over the parsed tree is skipped when the raw bytes already rule its
    # finding out: nesting needs an opening bracket per level, and JSON can carry
    # U+0000 only as the escape ``\u0000`` (a raw control byte is malformed JSON).
    if _may_nest(body) and _depth(raw) > MAX_DEPTH + 4:
        raise DecodeError("non_canonical_value", f"nested deeper than {MAX_DEPTH} levels")
    if b"\\u0000" in body and _has_nul(raw):
        # Postgres text and jsonb cannot hold U+0000: refuse it here, with a reason,
        # rather than let it fail a whole batch's transaction later.
        raise DecodeError("non_canonical_value", "a string contains U+0000")
    try:
        return adapter.validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        kinds = {e["type"] for e in errors}
        if kinds & _UNKNOWN_TYPE or any(e["loc"] == ("type",) for e in errors):
            raise DecodeError("unknown_type", f"type={raw.get('type')!r}") from None
        if "non_canonical_value" in kinds:
            raise DecodeError("non_canonical_value", _summary(errors)) from None
        raise DecodeError("schema", _summary(errors)) from None


def _may_nest(body: bytes) -> bool:
    """False when the body has too few brackets to nest deeper than the limit."""
    return body.count(b"{") + body.count(b"[") > MAX_DEPTH + 4


def _depth(value: Any) -> int:
    """Nesting depth, iteratively (no recursion limit to hit on hostile input)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH + 4:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _has_nul(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if depth > 64:
        return False
    if isinstance(value, dict):
        return any("\x00" in k or _has_nul(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v, depth + 1) for v in value)
    return False


def _summary(errors: list[Any]) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:5]]
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


Command = SubmitCommand | QueryCommand | CancelCommand
Receipt = OperationReceipt | QueryAnswer
Request = StartRequest | CancelRequest


def decode_command(body: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Command:
    """Decode a :data:`ServiceCommand` (submit, query or cancel)."""
    result: Command = _decode(_command, body, max_bytes)
    return result


def decode_receipt(body: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Receipt:
    """Decode a :data:`ReceiptMessage` (a receipt or a query answer)."""
    result: Receipt = _decode(_receipt, body, max_bytes)
    return result


def decode_start(body: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> StartRequest:
    """Decode a :class:`StartRequest`."""
    result: StartRequest = _decode(_start, body, max_bytes)
    return result


def decode_request(body: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Request:
    """Decode a :data:`RequestMessage` (a start request or a cancel request)."""
    result: Request = _decode(_request, body, max_bytes)
    return result


def encode(model: BaseModel) -> bytes:
    """The wire bytes of a model (compact JSON, UTF-8)."""
    return orjson.dumps(model.model_dump(mode="json"))


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas published in ``contracts/schemas`` (regenerated by a command)."""
    from contracts import models

    return {
        "service-command": _command.json_schema(),
        "receipt-message": _receipt.json_schema(),
        "start-request": _start.json_schema(),
        "request-message": _request.json_schema(),
        "executor-route": TypeAdapter(models.ExecutorRoute).json_schema(),
    }
