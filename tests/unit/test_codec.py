"""The one codec: bytes to models and back (contracts/codec.py).

"Decoding never raises anything but DecodeError, whose reason is a stable,
machine-readable code used for quarantine rows and metrics." Every message carries a
literal type with its version; unknown versions are refused, never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from contracts import codec, digest, identity
from contracts.codec import DecodeError
from contracts.models import (
    CancelCommand,
    Lineage,
    OperationReceipt,
    QueryAnswer,
    QueryCommand,
    ReceiptError,
    StartRequest,
    SubmitCommand,
    Target,
)
from workers.core.validation import REASONS

FAST = settings(deadline=None, database=None, max_examples=100)
Decoder = Callable[[bytes], Any]

T0 = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)
START_ID = "3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00"
INSTANCE = identity.instance_id("acme", START_ID)
OP = identity.operation_id("acme", INSTANCE, "reserve", 1)
SUBMIT_ID = identity.request_id(OP, 1, "submit")
QUERY_ID = identity.request_id(OP, 1, "query")
CANCEL_ID = identity.request_id(OP, 1, "cancel")
TARGET = Target(route="inventory", owner="inventory", binding="inventory.v1")
LINEAGE = Lineage(
    instance_id=INSTANCE,
    process="order-fulfilment",
    process_version=1,
    node="reserve",
    activation=1,
)
DIGEST = "ab" * 32


def submit() -> SubmitCommand:
    return SubmitCommand(
        request_id=SUBMIT_ID,
        tenant="acme",
        operation_id=OP,
        attempt=1,
        operation="inventory.reserve",
        target=TARGET,
        digest=DIGEST,
        issued_at=T0,
        input={"order_id": "o-1", "sku": "SKU-1", "quantity": 2, "note": "Zoë"},
        lineage=LINEAGE,
        deadline=T0,
    )


def query() -> QueryCommand:
    return QueryCommand(
        request_id=QUERY_ID,
        tenant="acme",
        operation_id=OP,
        attempt=1,
        operation="inventory.reserve",
        target=TARGET,
        digest=DIGEST,
        issued_at=T0,
        submit_request_id=SUBMIT_ID,
    )


def cancel() -> CancelCommand:
    return CancelCommand(
        request_id=CANCEL_ID,
        tenant="acme",
        operation_id=OP,
        attempt=1,
        operation="inventory.reserve",
        target=TARGET,
        digest=DIGEST,
        issued_at=T0,
        submit_request_id=SUBMIT_ID,
        reason="customer withdrew the order",
    )


def receipt(**changes: Any) -> OperationReceipt:
    values: dict[str, Any] = {
        "receipt_id": identity.receipt_id(SUBMIT_ID, 2),
        "tenant": "acme",
        "operation_id": OP,
        "attempt": 1,
        "request_id": SUBMIT_ID,
        "in_reply_to": SUBMIT_ID,
        "owner": "inventory",
        "principal": "custody-inventory",
        "command_digest": DIGEST,
        "owner_revision": 2,
        "status": "succeeded",
        "effect": "applied",
        "result": {"reservation_id": "r-1"},
        "emitted_at": T0,
    }
    values.update(changes)
    return OperationReceipt(**values)


def answer(inner: OperationReceipt | None) -> QueryAnswer:
    return QueryAnswer(
        answer_id=identity.answer_id(QUERY_ID, 2),
        tenant="acme",
        operation_id=OP,
        attempt=1,
        request_id=SUBMIT_ID,
        in_reply_to=QUERY_ID,
        owner="inventory",
        principal="custody-inventory",
        receipt=inner,
        emitted_at=T0,
    )


def start() -> StartRequest:
    return StartRequest(
        tenant="acme",
        start_request_id=START_ID,
        process="order-fulfilment",
        input={"order_id": "o-1", "sku": "SKU-1", "quantity": 2},
        requested_by="shop",
    )


MESSAGES: list[tuple[str, Callable[[], BaseModel], Decoder]] = [
    ("submit", submit, codec.decode_command),
    ("query", query, codec.decode_command),
    ("cancel", cancel, codec.decode_command),
    ("receipt", receipt, codec.decode_receipt),
    (
        "failed-receipt",
        lambda: receipt(
            status="failed",
            effect="unknown",
            result=None,
            error=ReceiptError(code="timeout", message="upstream did not answer"),
        ),
        codec.decode_receipt,
    ),
    ("answer", lambda: answer(receipt()), codec.decode_receipt),
    ("null-answer", lambda: answer(None), codec.decode_receipt),
    ("start", start, codec.decode_start),
]
DECODERS: list[tuple[str, Decoder, Callable[[], BaseModel]]] = [
    ("command", codec.decode_command, submit),
    ("receipt", codec.decode_receipt, receipt),
    ("start", codec.decode_start, start),
]


def raw(model: BaseModel) -> dict[str, Any]:
    result: dict[str, Any] = orjson.loads(codec.encode(model))
    return result


def reason_of(decode: Decoder, body: bytes | dict[str, Any] | list[Any]) -> str:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.reason in REASONS
    return info.value.reason


def nested_lists(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


# --- round trip ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "make", "decode"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_encode_then_decode_gives_an_equal_model(
    name: str, make: Callable[[], BaseModel], decode: Decoder
) -> None:
    model = make()
    decoded = decode(codec.encode(model))
    assert type(decoded) is type(model)
    assert decoded == model
    assert codec.encode(decoded) == codec.encode(model)


@pytest.mark.parametrize(("name", "make", "decode"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_every_message_carries_its_literal_versioned_type(
    name: str, make: Callable[[], BaseModel], decode: Decoder
) -> None:
    assert raw(make())["type"].startswith("custody.")
    assert raw(make())["type"].endswith(".v1")


# --- the stable reasons -------------------------------------------------------------


@pytest.mark.parametrize(("name", "decode", "make"), DECODERS, ids=[d[0] for d in DECODERS])
def test_a_message_over_max_bytes_is_refused_as_oversized(
    name: str, decode: Decoder, make: Callable[[], BaseModel]
) -> None:
    body = codec.encode(make())
    limit = len(body) + 10
    padded = body + b" " * (limit - len(body))  # trailing white space is valid JSON
    assert decode(padded, limit) == make()  # type: ignore[call-arg]
    with pytest.raises(DecodeError) as info:
        decode(padded + b" ", limit)  # type: ignore[call-arg]
    assert info.value.reason == "oversized"
    # The size is checked before anything is parsed.
    assert reason_of(lambda b: decode(b, 16), b"\xff" * 17) == "oversized"  # type: ignore[call-arg]


def test_the_default_limit_is_256_kib() -> None:
    big = submit().model_copy(update={"input": {"blob": "x" * codec.DEFAULT_MAX_BYTES}})
    assert reason_of(codec.decode_command, codec.encode(big)) == "oversized"


@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\x80"],
    ids=["ff", "overlong", "encoded-surrogate", "truncated-sequence", "lone-continuation"],
)
@pytest.mark.parametrize(("name", "decode", "make"), DECODERS, ids=[d[0] for d in DECODERS])
def test_bytes_that_are_not_utf8_are_refused_as_not_utf8(
    name: str, decode: Decoder, make: Callable[[], BaseModel], bad: bytes
) -> None:
    body = codec.encode(make()).replace(b'"acme"', b'"ac' + bad + b'me"')
    assert reason_of(decode, body) == "not_utf8"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:-1],
        lambda b: b"",
        lambda b: b + b"}",
        lambda b: b + b" trailing",
        lambda b: b.replace(b'"acme"', b"'acme'"),
        lambda b: b.replace(b":", b"=", 1),
        lambda b: b"\xef\xbb\xbf" + b,
        lambda b: b"{" + b"," + b[1:],
    ],
    ids=[
        "half",
        "truncated-by-one",
        "empty",
        "extra-brace",
        "trailing-garbage",
        "single-quotes",
        "not-a-colon",
        "byte-order-mark",
        "leading-comma",
    ],
)
@pytest.mark.parametrize(("name", "decode", "make"), DECODERS, ids=[d[0] for d in DECODERS])
def test_bytes_that_are_not_json_are_refused_as_malformed_json(
    name: str, decode: Decoder, make: Callable[[], BaseModel], mangle: Callable[[bytes], bytes]
) -> None:
    assert reason_of(decode, mangle(codec.encode(make()))) == "malformed_json"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(literal: bytes) -> None:
    body = codec.encode(submit()).replace(b'"quantity":2', b'"quantity":' + literal)
    assert reason_of(codec.decode_command, body) == "malformed_json"


@pytest.mark.parametrize(
    "top",
    [[], [{}], "a string", 1, None, True],
    ids=["array", "array-of-object", "str", "int", "null", "bool"],
)
@pytest.mark.parametrize(("name", "decode", "make"), DECODERS, ids=[d[0] for d in DECODERS])
def test_a_top_level_that_is_not_an_object_is_refused_as_schema(
    name: str, decode: Decoder, make: Callable[[], BaseModel], top: Any
) -> None:
    assert reason_of(decode, orjson.dumps(top)) == "schema"


def test_a_message_wrapped_in_an_array_is_refused_as_schema() -> None:
    assert reason_of(codec.decode_command, [raw(submit())]) == "schema"


SCHEMA_CASES: list[tuple[str, Callable[[], BaseModel], Decoder, Callable[[dict[str, Any]], Any]]]
SCHEMA_CASES = [
    ("unknown-field", submit, codec.decode_command, lambda m: m.update(url="http://x")),
    (
        "unknown-nested-field",
        submit,
        codec.decode_command,
        lambda m: m["target"].update(queue="elsewhere"),
    ),
    ("missing-field", submit, codec.decode_command, lambda m: m.pop("tenant")),
    ("missing-input", submit, codec.decode_command, lambda m: m.pop("input")),
    ("missing-lineage-field", submit, codec.decode_command, lambda m: m["lineage"].pop("node")),
    ("string-for-int", submit, codec.decode_command, lambda m: m.update(attempt="1")),
    ("bool-for-int", submit, codec.decode_command, lambda m: m.update(attempt=True)),
    ("float-for-int", submit, codec.decode_command, lambda m: m.update(attempt=1.0)),
    ("int-for-string", submit, codec.decode_command, lambda m: m.update(tenant=1)),
    ("attempt-zero", submit, codec.decode_command, lambda m: m.update(attempt=0)),
    ("bad-uuid", submit, codec.decode_command, lambda m: m.update(operation_id="op-1")),
    ("uppercase-uuid", submit, codec.decode_command, lambda m: m.update(operation_id=OP.upper())),
    ("bad-digest", submit, codec.decode_command, lambda m: m.update(digest="AB" * 32)),
    ("bad-name", submit, codec.decode_command, lambda m: m.update(tenant="Acme Corp")),
    ("timestamp-as-int", submit, codec.decode_command, lambda m: m.update(issued_at=1704110400)),
    ("input-not-object", submit, codec.decode_command, lambda m: m.update(input=[1, 2])),
    ("input-null", submit, codec.decode_command, lambda m: m.update(input=None)),
    ("query-without-submit-id", query, codec.decode_command, lambda m: m.pop("submit_request_id")),
    ("cancel-reason-too-long", cancel, codec.decode_command, lambda m: m.update(reason="x" * 2001)),
    ("unknown-receipt-status", receipt, codec.decode_receipt, lambda m: m.update(status="done")),
    ("unknown-effect", receipt, codec.decode_receipt, lambda m: m.update(effect="maybe")),
    ("revision-zero", receipt, codec.decode_receipt, lambda m: m.update(owner_revision=0)),
    ("revision-as-string", receipt, codec.decode_receipt, lambda m: m.update(owner_revision="2")),
    ("result-not-object", receipt, codec.decode_receipt, lambda m: m.update(result="ok")),
    (
        "error-extra-field",
        receipt,
        codec.decode_receipt,
        lambda m: m.update(error={"code": "x", "message": "y", "trace": "z"}),
    ),
    (
        "answer-missing-receipt-key",
        lambda: answer(None),
        codec.decode_receipt,
        lambda m: m.pop("receipt"),
    ),
    (
        "answer-receipt-wrong-type",
        lambda: answer(receipt()),
        codec.decode_receipt,
        lambda m: m["receipt"].update(attempt="1"),
    ),
    ("start-unknown-field", start, codec.decode_start, lambda m: m.update(priority=1)),
    ("start-missing-process", start, codec.decode_start, lambda m: m.pop("process")),
    ("start-input-array", start, codec.decode_start, lambda m: m.update(input=[])),
]


@pytest.mark.parametrize(
    ("case", "make", "decode", "edit"), SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES]
)
def test_a_message_that_breaks_the_schema_is_refused_as_schema(
    case: str, make: Callable[[], BaseModel], decode: Decoder, edit: Callable[[Any], Any]
) -> None:
    """Models are strict (no coercion, "1" is not an int) and forbid extra keys."""
    message = raw(make())
    edit(message)
    assert reason_of(decode, message) == "schema"


UNKNOWN_TYPE_CASES: list[tuple[str, Callable[[], BaseModel], Decoder, Any]] = [
    ("command-v2", submit, codec.decode_command, "custody.command.submit.v2"),
    ("command-unknown-kind", submit, codec.decode_command, "custody.command.frobnicate.v1"),
    ("command-missing-type", submit, codec.decode_command, None),
    ("command-type-not-a-string", submit, codec.decode_command, 1),
    ("receipt-v2", receipt, codec.decode_receipt, "custody.receipt.v2"),
    ("receipt-missing-type", receipt, codec.decode_receipt, None),
    ("answer-v0", lambda: answer(None), codec.decode_receipt, "custody.query-answer.v0"),
    ("start-v2", start, codec.decode_start, "custody.start.v2"),
    ("start-type-not-a-string", start, codec.decode_start, ["custody.start.v1"]),
    pytest.param(
        "start-missing-type",
        start,
        codec.decode_start,
        None,
    ),
]


@pytest.mark.parametrize(("case", "make", "decode", "type_"), UNKNOWN_TYPE_CASES)
def test_an_unknown_or_missing_type_is_refused_never_guessed(
    case: str, make: Callable[[], BaseModel], decode: Decoder, type_: Any
) -> None:
    """Every message carries a literal type with its version; unknown versions are
    refused, never guessed."""
    message = raw(make())
    if type_ is None:
        del message["type"]
    else:
        message["type"] = type_
    assert reason_of(decode, message) == "unknown_type"


def test_a_query_answers_receipt_without_a_type_is_refused() -> None:
    message = raw(answer(receipt()))
    del message["receipt"]["type"]
    with pytest.raises(DecodeError):
        codec.decode_receipt(orjson.dumps(message))


@pytest.mark.parametrize(
    ("body", "decode"),
    [
        (lambda: receipt(), codec.decode_command),
        (lambda: start(), codec.decode_command),
        (lambda: submit(), codec.decode_receipt),
        (lambda: start(), codec.decode_receipt),
        (lambda: submit(), codec.decode_start),
        (lambda: receipt(), codec.decode_start),
    ],
    ids=[
        "receipt-as-command",
        "start-as-command",
        "command-as-receipt",
        "start-as-receipt",
        "command-as-start",
        "receipt-as-start",
    ],
)
def test_a_message_on_the_wrong_queue_is_refused_as_unknown_type(
    body: Callable[[], BaseModel], decode: Decoder
) -> None:
    assert reason_of(decode, codec.encode(body())) == "unknown_type"


NON_CANONICAL: list[tuple[str, Callable[[], BaseModel], Decoder, Callable[[Any], Any]]] = [
    ("float-in-input", submit, codec.decode_command, lambda m: m["input"].update(price=19.99)),
    ("integral-float-in-input", submit, codec.decode_command, lambda m: m["input"].update(n=1.0)),
    ("exponent-in-input", submit, codec.decode_command, lambda m: m["input"].update(n=1e3)),
    ("above-2**53-in-input", submit, codec.decode_command, lambda m: m["input"].update(n=2**53)),
    (
        "below--(2**53)-in-input",
        submit,
        codec.decode_command,
        lambda m: m["input"].update(n=-(2**53)),
    ),
    (
        "float-deep-in-input",
        submit,
        codec.decode_command,
        lambda m: m["input"].update(lines=[{"price": 0.5}]),
    ),
    ("nul-in-input", submit, codec.decode_command, lambda m: m["input"].update(s="a\x00b")),
    ("float-in-result", receipt, codec.decode_receipt, lambda m: m["result"].update(total=9.5)),
    (
        "huge-int-in-answer-receipt",
        lambda: answer(receipt()),
        codec.decode_receipt,
        lambda m: m["receipt"]["result"].update(n=2**60),
    ),
    ("float-in-start-input", start, codec.decode_start, lambda m: m["input"].update(q=2.5)),
]


@pytest.mark.parametrize(
    ("case", "make", "decode", "edit"), NON_CANONICAL, ids=[c[0] for c in NON_CANONICAL]
)
def test_a_value_outside_the_digest_domain_is_refused_as_non_canonical(
    case: str, make: Callable[[], BaseModel], decode: Decoder, edit: Callable[[Any], Any]
) -> None:
    """Floats are not allowed anywhere in the digest domain; integers stay within
    ±(2**53-1)."""
    message = raw(make())
    edit(message)
    assert reason_of(decode, message) == "non_canonical_value"


def test_an_integer_beyond_64_bits_is_refused_as_non_canonical() -> None:
    body = codec.encode(submit()).replace(b'"quantity":2', b'"quantity":' + b"9" * 40)
    assert reason_of(codec.decode_command, body) == "non_canonical_value"


def test_a_float_too_large_for_a_double_is_refused_as_non_canonical() -> None:
    body = codec.encode(submit()).replace(b'"quantity":2', b'"quantity":1e400')
    assert reason_of(codec.decode_command, body) == "non_canonical_value"


@pytest.mark.parametrize(
    "depth",
    [
        digest.MAX_DEPTH + 1,
        100,
        150,
        250,
        2000,
    ],
)
def test_input_nested_deeper_than_max_depth_is_refused_as_non_canonical(depth: int) -> None:
    """A value nested too deep has no canonical form, however deep it is."""
    deep = submit().model_copy(update={"input": {"a": "DEEP"}})
    body = codec.encode(deep).replace(b'"DEEP"', b"[" * depth + b"]" * depth)
    assert reason_of(codec.decode_command, body) == "non_canonical_value"


def test_input_nested_up_to_max_depth_is_accepted() -> None:
    """The input sits one level below the digested object, so its own nesting may be
    MAX_DEPTH - 1 deep (what the digest can hold, and no more)."""
    message = raw(start())
    message["input"] = {"a": nested_lists(digest.MAX_DEPTH - 1)}
    assert codec.decode_start(orjson.dumps(message)).input == message["input"]


def test_decode_error_carries_its_reason_and_detail() -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode_command(b"[]")
    assert info.value.reason == "schema"
    assert info.value.detail
    assert str(info.value).startswith("schema: ")
    assert isinstance(info.value, ValueError)


# --- fuzzing: nothing but DecodeError -----------------------------------------------


def outcome(decode: Decoder, body: bytes) -> str | None:
    """None when the body decodes, else the DecodeError's reason; anything else that
    is raised fails the test."""
    try:
        decode(body)
    except DecodeError as exc:
        return exc.reason
    return None


@pytest.mark.parametrize(("name", "decode", "make"), DECODERS, ids=[d[0] for d in DECODERS])
@FAST
@given(body=st.binary(max_size=512))
def test_arbitrary_bytes_never_raise_anything_but_decode_error(
    name: str, decode: Decoder, make: Callable[[], BaseModel], body: bytes
) -> None:
    assert outcome(decode, body) in (None, *REASONS)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@pytest.mark.parametrize(("name", "make", "decode"), MESSAGES, ids=[m[0] for m in MESSAGES])
@FAST
@given(data=st.data())
def test_mutated_messages_never_raise_anything_but_decode_error(
    name: str, make: Callable[[], BaseModel], decode: Decoder, data: st.DataObject
) -> None:
    message = raw(make())
    key = data.draw(st.sampled_from([*message, "extra"]))
    message[key] = data.draw(_JSON)
    body = json.dumps(message).encode()
    reason = outcome(decode, body)
    assert reason in (None, *REASONS)
    if reason is None:
        decoded = decode(body)
        assert decode(codec.encode(decoded)) == decoded


@pytest.mark.parametrize(("name", "make", "decode"), MESSAGES, ids=[m[0] for m in MESSAGES])
@FAST
@given(data=st.data())
def test_corrupted_bytes_never_raise_anything_but_decode_error(
    name: str, make: Callable[[], BaseModel], decode: Decoder, data: st.DataObject
) -> None:
    body = bytearray(codec.encode(make()))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    assert outcome(decode, bytes(body)) in (None, *REASONS)


# The decoder skips its walks over the parsed tree when the raw bytes rule their
# finding out (too few brackets to nest too deep; no ``\u0000`` escape): the
# decisions must be the ones the walks make.


def test_the_text_of_a_nul_escape_is_not_a_nul() -> None:
    """An escaped backslash before ``u0000`` is six ordinary characters."""
    message = raw(submit())
    message["input"]["note"] = "\\u0000"
    body = orjson.dumps(message)
    assert b"\\\\u0000" in body
    assert codec.decode_command(body).input["note"] == "\\u0000"


def test_a_nul_in_a_key_is_refused_as_non_canonical() -> None:
    message = raw(submit())
    message["input"]["a\x00b"] = 1
    body = orjson.dumps(message)
    assert b"\\u0000" in body
    assert reason_of(codec.decode_command, body) == "non_canonical_value"


def test_many_shallow_brackets_are_walked_and_accepted() -> None:
    """More brackets than the depth limit, none of them deep: the walk runs and passes."""
    message = raw(start())
    message["input"] = {"lines": [{"sku": f"S{i}", "qty": [i]} for i in range(40)]}
    body = orjson.dumps(message)
    assert body.count(b"{") + body.count(b"[") > digest.MAX_DEPTH + 4
    assert codec.decode_start(body).input == message["input"]


@pytest.mark.parametrize("depth", [digest.MAX_DEPTH + 1, 40, 100])
def test_nesting_too_deep_inside_a_list_of_objects_is_refused(depth: int) -> None:
    message = raw(start())
    message["input"] = {"lines": [{"x": nested_lists(depth)}]}
    assert reason_of(codec.decode_start, orjson.dumps(message)) == "non_canonical_value"
