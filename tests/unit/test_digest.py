"""The semantic command digest (DESIGN §2) and its published test vectors.

"A participant persists the semantic command digest so repeated delivery cannot
silently change the requested work." The canonical form is published in
docs/digest.md and contracts/vectors/digest.json so that a participant in another
language computes the same bytes; these tests keep the code, the vectors and the
document in agreement.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import codec, digest, identity
from contracts.digest import MAX_DEPTH, MAX_SAFE_INTEGER, CanonicalFormError
from contracts.models import Lineage, SubmitCommand, Target

ROOT = Path(__file__).resolve().parents[2]
VECTORS = json.loads((ROOT / "contracts" / "vectors" / "digest.json").read_text("utf-8"))
BY_NAME = {v["name"]: v for v in VECTORS["vectors"]}
BASE: dict[str, Any] = BY_NAME["ascii"]["fields"]
FAST = settings(deadline=None, database=None, max_examples=100)


def body_of(fields: dict[str, Any]) -> dict[str, Any]:
    """The canonical body as docs/digest.md spells it out."""
    return {
        "v": "custody.digest.v1",
        "tenant": fields["tenant"],
        "operation_id": fields["operation_id"],
        "attempt": fields["attempt"],
        "operation": fields["operation"],
        "target": {
            "route": fields["route"],
            "owner": fields["owner"],
            "binding": fields["binding"],
        },
        "input": fields["input"],
        "lineage": fields["lineage"],
    }


def reference_bytes(value: Any) -> bytes:
    """An independent canonicalizer, from the document alone: a standard JSON writer
    with sorted keys, compact separators and UTF-8 output."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def nested_lists(depth: int) -> Any:
    """``depth`` lists, one inside the other."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


# --- the published vectors ---------------------------------------------------------


def test_the_vectors_cover_the_cases_a_second_implementation_gets_wrong() -> None:
    names = [v["name"] for v in VECTORS["vectors"]]
    assert len(names) == len(set(names)) >= 8
    assert {
        "ascii",
        "empty-input",
        "key-order-a",
        "key-order-b",
        "non-ascii",
        "nested",
        "literals",
        "safe-integers",
        "control-characters",
    } <= set(names)
    assert VECTORS["version"] == digest.DIGEST_VERSION


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_each_vector_recomputes_to_its_canonical_bytes_and_digest(vector: dict[str, Any]) -> None:
    """A participant persists the semantic command digest: the published canonical
    bytes and SHA-256 are exactly what the code computes."""
    fields = vector["fields"]
    canonical = vector["canonical"].encode("utf-8")
    assert digest.canonical_bytes(body_of(fields)) == canonical
    assert digest.command_digest(**fields) == vector["sha256"]
    assert hashlib.sha256(canonical).hexdigest() == vector["sha256"]


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_a_standard_json_writer_reproduces_each_vector(vector: dict[str, Any]) -> None:
    """The canonical form is computable in another language: a standard JSON writer
    configured as docs/digest.md says yields the same bytes."""
    assert reference_bytes(body_of(vector["fields"])) == vector["canonical"].encode("utf-8")


def test_the_empty_input_vector_matches_the_document_byte_for_byte() -> None:
    """Written out by hand from docs/digest.md, not computed."""
    fields = BY_NAME["empty-input"]["fields"]
    lineage = fields["lineage"]
    expected = (
        '{"attempt":1,"input":{},"lineage":{"activation":1,'
        f'"instance_id":"{lineage["instance_id"]}","node":"reserve",'
        '"process":"order-fulfilment","process_version":1},'
        '"operation":"inventory.reserve",'
        f'"operation_id":"{fields["operation_id"]}",'
        '"target":{"binding":"inventory.v1","owner":"inventory","route":"inventory"},'
        '"tenant":"acme","v":"custody.digest.v1"}'
    )
    assert BY_NAME["empty-input"]["canonical"] == expected


def test_key_order_in_the_input_does_not_change_the_digest() -> None:
    a, b = BY_NAME["key-order-a"], BY_NAME["key-order-b"]
    assert list(a["fields"]["input"]) != list(b["fields"]["input"])
    assert a["canonical"] == b["canonical"]
    assert a["sha256"] == b["sha256"]


def test_non_ascii_is_written_as_utf8_and_keys_sort_by_code_point() -> None:
    """Non-ASCII characters are written as themselves; keys sort by Unicode code point
    (U+FFFF before U+1F600, which UTF-16 code-unit order would reverse)."""
    canonical = BY_NAME["non-ascii"]["canonical"]
    assert "東京" in canonical
    assert "\\u" not in canonical
    assert canonical.index('"\uffff":') < canonical.index('"\U0001f600":')


def test_control_characters_are_escaped_as_json_requires() -> None:
    canonical = BY_NAME["control-characters"]["canonical"]
    assert "\\u0001" in canonical
    assert "\\u001f" in canonical
    assert "\\b\\t\\n\\u000b\\f\\r" in canonical
    assert '"a/b"' in canonical  # the solidus is not escaped
    assert "\x7f" in canonical
    assert "\u2028\u2029" in canonical
    assert not any(ord(c) < 0x20 for c in canonical)


@pytest.mark.parametrize("case", VECTORS["refused"], ids=lambda v: v["name"])
def test_each_published_refusal_is_refused(case: dict[str, Any]) -> None:
    with pytest.raises(CanonicalFormError):
        digest.command_digest(**{**BASE, "input": case["input"]})


def test_a_submit_command_digests_to_the_published_vector() -> None:
    """semantic_digest() of a command built from a vector's fields is the vector's
    digest: what the engine sends is what the participant recomputes."""
    command = submit_command(BASE)
    assert command.semantic_digest() == BY_NAME["ascii"]["sha256"]


# --- the digest domain -------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        1.5,
        1.0,
        -0.0,
        math.nan,
        math.inf,
        -math.inf,
        MAX_SAFE_INTEGER + 1,
        -MAX_SAFE_INTEGER - 1,
        2**64,
        -(2**64),
    ],
    ids=repr,
)
def test_floats_and_integers_beyond_the_interoperable_range_are_refused(value: Any) -> None:
    """Numbers are integers in [-(2**53-1), 2**53-1]; floats are not allowed anywhere."""
    with pytest.raises(CanonicalFormError):
        digest.command_digest(**{**BASE, "input": {"n": value}})
    with pytest.raises(CanonicalFormError):
        digest.command_digest(**{**BASE, "input": {"list": [{"deep": value}]}})


@pytest.mark.parametrize("value", [MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, 0], ids=repr)
def test_the_interoperable_integer_bounds_are_accepted(value: int) -> None:
    assert str(value).encode() in digest.canonical_bytes({"n": value})


def test_booleans_are_not_integers() -> None:
    """True and 1 are different semantic input (Python's bool is an int)."""
    assert digest.canonical_bytes({"a": True}) == b'{"a":true}'
    assert digest.command_digest(**{**BASE, "input": {"a": True}}) != digest.command_digest(
        **{**BASE, "input": {"a": 1}}
    )


def test_nesting_up_to_max_depth_is_accepted_and_deeper_is_refused() -> None:
    digest.check_json_value(nested_lists(MAX_DEPTH + 1))  # the outermost list is level 0
    with pytest.raises(CanonicalFormError, match="deeper"):
        digest.check_json_value(nested_lists(MAX_DEPTH + 2))
    # In the body, input is level 1 and its members level 2 (docs/digest.md).
    digest.command_digest(**{**BASE, "input": {"a": nested_lists(MAX_DEPTH - 1)}})
    with pytest.raises(CanonicalFormError):
        digest.command_digest(**{**BASE, "input": {"a": nested_lists(MAX_DEPTH)}})


@pytest.mark.parametrize(
    "bad",
    [{1: "int key"}, {("a",): "tuple key"}, {None: "null key"}, {b"a": "bytes key"}],
    ids=["int", "tuple", "none", "bytes"],
)
def test_non_string_keys_are_refused(bad: dict[Any, Any]) -> None:
    with pytest.raises(CanonicalFormError, match="keys"):
        digest.command_digest(**{**BASE, "input": {"nested": bad}})
    with pytest.raises(CanonicalFormError):
        digest.canonical_bytes(bad)


@pytest.mark.parametrize(
    "value",
    [(1, 2), {1, 2}, b"bytes", Decimal("1.5"), datetime(2024, 1, 1, tzinfo=UTC), object()],
    ids=["tuple", "set", "bytes", "decimal", "datetime", "object"],
)
def test_values_that_are_not_json_are_refused(value: Any) -> None:
    with pytest.raises(CanonicalFormError):
        digest.command_digest(**{**BASE, "input": {"v": value}})


@pytest.mark.parametrize("where", ["value", "key"])
def test_nul_characters_are_refused(where: str) -> None:
    bad = {"s": "a\x00b"} if where == "value" else {"a\x00": 1}
    with pytest.raises(CanonicalFormError, match="U\\+0000"):
        digest.command_digest(**{**BASE, "input": bad})


def test_a_lone_surrogate_is_refused_as_non_canonical() -> None:
    """CanonicalFormError is the one error for a value outside the digest domain: a
    string that has no UTF-8 form cannot be put in canonical form."""
    with pytest.raises(CanonicalFormError):
        digest.command_digest(**{**BASE, "input": {"s": "\ud800"}})


# --- what the digest binds ----------------------------------------------------------

SEMANTIC_CHANGES = {
    "tenant": {"tenant": "globex"},
    "operation_id": {"operation_id": identity.operation_id("acme", "i", "reserve", 2)},
    "attempt": {"attempt": 2},
    "operation": {"operation": "inventory.release"},
    "route": {"route": "inventory-eu"},
    "owner": {"owner": "inventory-eu"},
    "binding": {"binding": "inventory.v2"},
    "input": {"input": {**BASE["input"], "quantity": 3}},
    "input-key": {"input": {**BASE["input"], "note": ""}},
    "input-type": {"input": {**BASE["input"], "quantity": "2"}},
    "lineage.instance_id": {
        "lineage": {**BASE["lineage"], "instance_id": identity.instance_id("acme", "other")}
    },
    "lineage.process": {"lineage": {**BASE["lineage"], "process": "returns"}},
    "lineage.process_version": {"lineage": {**BASE["lineage"], "process_version": 2}},
    "lineage.node": {"lineage": {**BASE["lineage"], "node": "charge"}},
    "lineage.activation": {"lineage": {**BASE["lineage"], "activation": 2}},
}


@pytest.mark.parametrize("change", list(SEMANTIC_CHANGES), ids=str)
def test_changing_any_semantic_field_changes_the_digest(change: str) -> None:
    """A command binds its tenant, target, operation, attempt, immutable input and
    relevant business lineage: reusing that identity with changed input conflicts."""
    changed = {**BASE, **SEMANTIC_CHANGES[change]}
    assert digest.command_digest(**changed) != digest.command_digest(**BASE)


def test_distinct_semantic_changes_give_distinct_digests() -> None:
    digests = {digest.command_digest(**{**BASE, **c}) for c in SEMANTIC_CHANGES.values()}
    assert len(digests) == len(SEMANTIC_CHANGES)


def submit_command(fields: dict[str, Any], **transport: Any) -> SubmitCommand:
    values: dict[str, Any] = {
        "request_id": identity.request_id(fields["operation_id"], fields["attempt"], "submit"),
        "tenant": fields["tenant"],
        "operation_id": fields["operation_id"],
        "attempt": fields["attempt"],
        "operation": fields["operation"],
        "target": Target(route=fields["route"], owner=fields["owner"], binding=fields["binding"]),
        "digest": "0" * 64,
        "issued_at": datetime(2024, 1, 1, tzinfo=UTC),
        "input": fields["input"],
        "lineage": Lineage(**fields["lineage"]),
    }
    values.update(transport)
    return SubmitCommand(**values)


@pytest.mark.parametrize(
    "transport",
    [
        {"issued_at": datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)},
        {"deadline": datetime(2024, 1, 1, tzinfo=UTC) + timedelta(seconds=60)},
        {"request_id": identity.request_id(BASE["operation_id"], 1, "submit", 2)},
        {"digest": "f" * 64},
    ],
    ids=["issued_at", "deadline", "request_id", "digest"],
)
def test_transport_fields_do_not_define_semantic_identity(transport: dict[str, Any]) -> None:
    """Retry-varying tracing headers and transport delivery tags do not define semantic
    identity: issued-at, deadline and the request id are not in the digest."""
    assert submit_command(BASE, **transport).semantic_digest() == (
        submit_command(BASE).semantic_digest()
    )


def test_semantic_digest_is_the_command_digest_of_the_commands_own_fields() -> None:
    fields = {**BASE, "input": {"x": [1, {"y": None}]}, "attempt": 3}
    assert submit_command(fields).semantic_digest() == digest.command_digest(**fields)


def test_a_command_survives_the_wire_with_its_digest() -> None:
    """Repeated delivery cannot silently change the requested work: the participant
    recomputes, from the decoded bytes, the digest the engine computed."""
    command = submit_command(BASE)
    command = command.model_copy(update={"digest": command.semantic_digest()})
    decoded = codec.decode_command(codec.encode(command))
    assert decoded.semantic_digest() == decoded.digest == command.digest


def test_every_input_the_codec_accepts_has_a_digest() -> None:
    """A participant persists the semantic command digest: a command that decodes must
    have one, or a valid command crashes the participant (and the committer, for a
    start request's input rendered into a node's input)."""
    command = submit_command({**BASE, "input": {"a": nested_lists(MAX_DEPTH - 1)}})
    decoded = codec.decode_command(codec.encode(command))
    decoded.semantic_digest()


def test_content_hash_is_the_sha256_of_the_canonical_bytes() -> None:
    value = {"b": [1, "é"], "a": None}
    assert digest.content_hash(value) == hashlib.sha256(digest.canonical_bytes(value)).hexdigest()


# --- properties over the whole domain ------------------------------------------------

_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=12,
)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER)
    | _TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_TEXT, children, max_size=4),
    max_leaves=25,
)
_OBJECTS = st.dictionaries(_TEXT, _JSON, max_size=6)


@FAST
@given(_OBJECTS)
def test_a_standard_json_writer_agrees_on_every_value_in_the_domain(value: dict[str, Any]) -> None:
    assert digest.canonical_bytes(value) == reference_bytes(value)


@FAST
@given(_OBJECTS, st.randoms(use_true_random=False))
def test_key_insertion_order_never_changes_the_digest(value: dict[str, Any], rnd: Any) -> None:
    def shuffled(v: Any) -> Any:
        if isinstance(v, dict):
            items = list(v.items())
            rnd.shuffle(items)
            return {k: shuffled(x) for k, x in items}
        if isinstance(v, list):
            return [shuffled(x) for x in v]
        return v

    assert digest.command_digest(**{**BASE, "input": shuffled(value)}) == (
        digest.command_digest(**{**BASE, "input": value})
    )


@FAST
@given(_OBJECTS)
def test_canonical_bytes_are_valid_json_that_reads_back_equal(value: dict[str, Any]) -> None:
    assert orjson.loads(digest.canonical_bytes(value)) == value


class _Str(str):
    pass


class _Int(int):
    pass


_ANY_TEXT = st.text(max_size=6) | st.sampled_from(["a\x00", "\ud800", "é", "\x00", _Str("s")])
_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.sampled_from(
        [MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, MAX_SAFE_INTEGER + 1, 1.5, _Int(3), _Int(2**60)]
    )
    | _ANY_TEXT,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(_ANY_TEXT | st.integers(0, 2), children, max_size=3)
        | st.dictionaries(st.text(max_size=3), children, max_size=3).map(collections.OrderedDict)
        | st.tuples(children)
    ),
    max_leaves=20,
)


def _verdict(check: Any, value: Any, depth: int) -> str | None:
    try:
        check(value, depth)
    except CanonicalFormError as exc:
        return str(exc)
    return None


@FAST
@given(_ANY, st.integers(min_value=0, max_value=MAX_DEPTH + 1))
def test_the_fast_domain_check_decides_as_the_plain_one(value: Any, depth: int) -> None:
    """check_json_value's loop over plain JSON types (the hot path) accepts exactly what
    the value-by-value check accepts, and refuses with the same reason."""
    assert _verdict(digest.check_json_value, value, depth) == _verdict(
        digest.check_each_value, value, depth
    )
    if digest.plainly_in_domain(value, depth):
        assert _verdict(digest.check_each_value, value, depth) is None


@pytest.mark.parametrize("levels", [MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1])
@pytest.mark.parametrize("leaf", [[], [1], {"k": "v"}, {}], ids=["[]", "[1]", "{k}", "{}"])
def test_the_fast_domain_check_keeps_the_depth_bound(levels: int, leaf: Any) -> None:
    value: Any = leaf
    for _ in range(levels):
        value = [value]
    for depth in (0, 1):
        assert _verdict(digest.check_json_value, value, depth) == _verdict(
            digest.check_each_value, value, depth
        )


@pytest.mark.parametrize(
    "bad",
    [MAX_SAFE_INTEGER + 1, -MAX_SAFE_INTEGER - 1, 1.5, "a\x00", "\ud800", (1,), b"x"],
    ids=["above", "below", "float", "nul", "surrogate", "tuple", "bytes"],
)
@pytest.mark.parametrize("where", ["list", "value", "key"])
def test_the_fast_domain_check_refuses_each_value_outside_the_domain(bad: Any, where: str) -> None:
    if where == "key" and not isinstance(bad, str | int):
        value: Any = {"k": {(): bad}}  # not a valid key either way
    else:
        value = {"list": [1, bad], "value": {"k": bad}, "key": {bad: 1}}[where]
    assert _verdict(digest.check_json_value, value, 0) is not None
    assert _verdict(digest.check_json_value, value, 0) == _verdict(
        digest.check_each_value, value, 0
    )
