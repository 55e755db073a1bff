"""The canonical semantic digest of a command.

Canonical form (``custody.digest.v1``), so that a participant in another language can
compute the same bytes:

* a JSON object ``{"v": "custody.digest.v1", "tenant", "operation_id", "attempt",
  "operation", "target": {"route", "owner", "binding"}, "input", "lineage"}``;
* object keys sorted by Unicode code point, no insignificant white space, UTF-8,
  strings escaped as JSON requires (non-ASCII characters are written as themselves);
* numbers are integers in the interoperable range ``[-(2**53-1), 2**53-1]``; floats
  are not allowed anywhere in the digest domain (send decimals as strings);
* the digest is the lowercase hex SHA-256 of those bytes.

Transport facts (tracing headers, delivery tags, the redelivered flag, publish time,
``issued_at``, ``deadline``) are deliberately not part of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

DIGEST_VERSION = "custody.digest.v1"
MAX_SAFE_INTEGER = 2**53 - 1
MAX_DEPTH = 32

JsonValue = None | bool | int | str | list["JsonValue"] | dict[str, "JsonValue"]


class CanonicalFormError(ValueError):
    """A value cannot be put in canonical form (float, huge integer, too deep, bad key)."""


def check_json_value(value: object, depth: int = 0) -> None:
    """Raise :class:`CanonicalFormError` unless ``value`` is in the digest domain."""
    if not plainly_in_domain(value, depth):
        check_each_value(value, depth)  # says why (or finds it in after all: a subclass, say)


def plainly_in_domain(value: object, depth: int) -> bool:
    """True only if ``value`` is in the digest domain, made of the plain built-in types
    (``dict``, ``list``, ``str``, ``int``, ``bool``, None) that decoded JSON is: the
    hot path (every command and receipt is checked, in every worker), a loop instead
    of a call per value. False says nothing: :func:`check_each_value` decides, and says why."""
    if type(value) not in (dict, list):
        return False
    todo: list[tuple[Any, int]] = [(value, depth)]
    while todo:
        container, level = todo.pop()
        if level >= MAX_DEPTH:  # its items would be deeper than allowed (if it has any)
            return False
        items: Any
        if type(container) is dict:
            for key in container:
                if type(key) is not str or "\x00" in key or not (key.isascii() or _encodes(key)):
                    return False
            items = container.values()
        else:
            items = container
        for item in items:
            kind = type(item)
            if kind is str:
                # an ASCII string (a flag CPython keeps) cannot hold a lone surrogate
                if "\x00" in item or not (item.isascii() or _encodes(item)):
                    return False
            elif kind is int:
                if not -MAX_SAFE_INTEGER <= item <= MAX_SAFE_INTEGER:
                    return False
            elif kind is dict or kind is list:
                todo.append((item, level + 1))
            elif item is not None and kind is not bool:
                return False
    return True


def _encodes(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_each_value(value: object, depth: int = 0) -> None:
    """:func:`check_json_value` one value at a time, of any types: the reference its
    fast path is tested against, and what says why a value is refused."""
    if depth > MAX_DEPTH:
        raise CanonicalFormError(f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        _check_string(value)
        return
    if isinstance(value, int):
        if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            raise CanonicalFormError("integer outside the interoperable range ±(2**53-1)")
        return
    if isinstance(value, float):
        raise CanonicalFormError("floats are not allowed; send decimals as strings")
    if isinstance(value, list):
        for item in value:
            check_each_value(item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalFormError("object keys must be strings")
            _check_string(key)
            check_each_value(item, depth + 1)
        return
    raise CanonicalFormError(f"{type(value).__name__} is not a JSON value")


def _check_string(value: str) -> None:
    if "\x00" in value:
        raise CanonicalFormError("strings must not contain U+0000")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise CanonicalFormError("strings must be valid Unicode (no lone surrogates)") from None


def canonical_bytes(value: Mapping[str, Any]) -> bytes:
    """The canonical JSON bytes of ``value`` (sorted keys, compact, UTF-8)."""
    check_json_value(dict(value))
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def command_digest(
    *,
    tenant: str,
    operation_id: str,
    attempt: int,
    operation: str,
    route: str,
    owner: str,
    binding: str,
    input: Mapping[str, Any],
    lineage: Mapping[str, Any],
) -> str:
    """SHA-256 (hex) over the canonical form of the fields that define the work."""
    body = {
        "v": DIGEST_VERSION,
        "tenant": tenant,
        "operation_id": operation_id,
        "attempt": attempt,
        "operation": operation,
        "target": {"route": route, "owner": owner, "binding": binding},
        "input": dict(input),
        "lineage": dict(lineage),
    }
    return hashlib.sha256(canonical_bytes(body)).hexdigest()


def content_hash(value: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of an arbitrary JSON object's canonical form (receipt content)."""
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
