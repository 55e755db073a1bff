"""Deterministic identities (DESIGN §2) and their published vectors.

"Identities are deterministic from lineage, not random per try ... Re-creating the
same transition (after a crash or a restore) then yields the same command, which the
participant deduplicates instead of executing twice."
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from contracts import identity, models
from contracts.identity import CommandKind

ROOT = Path(__file__).resolve().parents[2]
VECTORS = json.loads((ROOT / "contracts" / "vectors" / "identity.json").read_text())
FUNCTIONS = ("instance_id", "operation_id", "request_id", "receipt_id", "answer_id")
FAST = settings(deadline=None, database=None, max_examples=100)

START = "3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00"
INSTANCE = identity.instance_id("acme", START)
OPERATION = identity.operation_id("acme", INSTANCE, "reserve", 1)


def test_the_vectors_cover_every_identity() -> None:
    assert {v["function"] for v in VECTORS["vectors"]} == set(FUNCTIONS)
    assert set(VECTORS["prefixes"]) == set(FUNCTIONS)
    assert uuid.UUID(VECTORS["namespace"]) == identity.NAMESPACE


@pytest.mark.parametrize(
    "vector", VECTORS["vectors"], ids=lambda v: f"{v['function']}:{v['description'][:30]}"
)
def test_each_identity_vector_recomputes(vector: dict[str, Any]) -> None:
    """Same inputs, same id: the published id is what the code derives."""
    function = getattr(identity, vector["function"])
    assert function(**vector["args"]) == vector["id"]


@pytest.mark.parametrize(
    "vector", VECTORS["vectors"], ids=lambda v: f"{v['function']}:{v['description'][:30]}"
)
def test_each_identity_vector_follows_the_published_rule(vector: dict[str, Any]) -> None:
    """A participant in another language derives the same ids from the description:
    uuid5(namespace, "<prefix>|<arg>|<arg>...")."""
    prefix = VECTORS["prefixes"][vector["function"]]
    name = "|".join([prefix, *(str(a) for a in vector["args"].values())])
    assert str(uuid.uuid5(uuid.UUID(VECTORS["namespace"]), name)) == vector["id"]


def test_the_vector_ids_are_all_distinct() -> None:
    ids = [v["id"] for v in VECTORS["vectors"]]
    assert len(ids) == len(set(ids))


def test_the_digest_vectors_use_these_identities() -> None:
    """The operation of the published digest vectors is the first activation of node
    reserve of the published instance: both vector files describe one transition."""
    digest_vectors = json.loads((ROOT / "contracts" / "vectors" / "digest.json").read_text())
    fields = digest_vectors["vectors"][0]["fields"]
    assert fields["lineage"]["instance_id"] == INSTANCE
    assert fields["operation_id"] == identity.operation_id(
        fields["tenant"], INSTANCE, fields["lineage"]["node"], fields["lineage"]["activation"]
    )


def test_recreating_the_same_transition_yields_the_same_ids() -> None:
    """Re-creating the same transition (after a crash or a restore) yields the same
    command: every id is a pure function of its lineage."""
    for _ in range(3):
        instance = identity.instance_id("acme", START)
        operation = identity.operation_id("acme", instance, "reserve", 1)
        request = identity.request_id(operation, 1, "submit")
        assert (instance, operation, request) == (
            INSTANCE,
            OPERATION,
            identity.request_id(OPERATION, 1, "submit", 1),
        )
        assert identity.receipt_id(request, 1) == identity.receipt_id(request, 1)
        assert identity.answer_id(request, 1) == identity.answer_id(request, 1)


def test_the_same_start_request_under_another_tenant_is_another_instance() -> None:
    assert identity.instance_id("acme", START) != identity.instance_id("globex", START)
    assert identity.operation_id("acme", INSTANCE, "reserve", 1) != identity.operation_id(
        "globex", INSTANCE, "reserve", 1
    )


def test_each_activation_and_node_is_another_operation() -> None:
    ids = {
        identity.operation_id("acme", INSTANCE, node, activation)
        for node in ("reserve", "charge")
        for activation in (1, 2, 3)
    }
    assert len(ids) == 6


def test_different_attempt_kind_or_sequence_is_a_different_request() -> None:
    """Retry-safe creates the allowed new attempt and command: attempt n+1 has its own
    request id, and submit, query and cancel of one attempt never share one."""
    kinds: tuple[CommandKind, ...] = get_args(CommandKind)
    combos = list(itertools.product((1, 2, 3), kinds, (1, 2, 3)))
    ids = {identity.request_id(OPERATION, a, k, s) for a, k, s in combos}
    assert len(ids) == len(combos)


def test_receipts_and_answers_never_share_an_id() -> None:
    request = identity.request_id(OPERATION, 1, "query")
    receipts = {identity.receipt_id(request, r) for r in range(1, 5)}
    answers = {identity.answer_id(request, r) for r in range(1, 5)}
    assert len(receipts) == len(answers) == 4
    assert not receipts & answers


@pytest.mark.parametrize("function", FUNCTIONS)
def test_every_derived_id_is_a_valid_contract_id(function: str) -> None:
    """Derived ids travel in the wire models, whose Id is a lowercase UUID."""
    args = {
        "instance_id": ("acme", START),
        "operation_id": ("acme", INSTANCE, "reserve", 1),
        "request_id": (OPERATION, 1, "submit"),
        "receipt_id": (OPERATION, 1),
        "answer_id": (OPERATION, 1),
    }[function]
    assert re.fullmatch(models.UUID_PATTERN, getattr(identity, function)(*args))


@pytest.mark.parametrize("annotated", [models.Id, models.Name, models.Tenant], ids=str)
def test_no_contract_name_or_id_contains_the_separator(annotated: Any) -> None:
    """Ids join their parts with "|": no tenant, node or id that the contracts accept
    contains it, so two different lineages can never join to the same name."""
    adapter: TypeAdapter[Any] = TypeAdapter(annotated)
    for value in ("a|b", "3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00|1"):
        with pytest.raises(ValidationError):
            adapter.validate_python(value)


@FAST
@given(
    st.tuples(st.integers(1, 10_000), st.sampled_from(get_args(CommandKind)), st.integers(1, 99)),
    st.tuples(st.integers(1, 10_000), st.sampled_from(get_args(CommandKind)), st.integers(1, 99)),
)
def test_request_ids_are_injective_over_attempt_kind_and_sequence(
    a: tuple[int, CommandKind, int], b: tuple[int, CommandKind, int]
) -> None:
    same_id = identity.request_id(OPERATION, *a) == identity.request_id(OPERATION, *b)
    assert same_id == (a == b)


def test_the_fast_derivation_is_rfc_4122_uuid5() -> None:
    """The derivation without a UUID object equals the standard library's uuid5 for any
    name (the vectors pin a few; this pins the construction)."""
    for name in ("", "a", "operation|acme|i|reserve|1", "é|☃|" * 50, "x" * 10_000):
        assert identity.uuid5_text(name) == str(uuid.uuid5(identity.NAMESPACE, name))
