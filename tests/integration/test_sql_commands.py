"""commands.sql builds the commands workers/core/commands.py builds, in the database.

The operator recovery commands run in Postgres (SECURITY DEFINER functions), so the SQL
building blocks must agree with the Python byte for byte where bytes are hashed
(canonical form, digest, identities) and model for model where a participant decodes
(command bodies, the attempts and outbox rows). Only Postgres is needed: the database
is made by ``custody db migrate`` (cli.cmd_migrate, which applies schema.sql and then
commands.sql), and real operation rows are made by the committer's own start path.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import hypothesis
import orjson
import psycopg
import pytest
from hypothesis import strategies as st
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from contracts import codec, digest, identity
from contracts.models import Lineage, StartRequest, SubmitCommand
from tests.conftest import RUN, admin_execute, database_url
from workers import provision
from workers.core import commands, process, tracing
from workers.engine import committer
from workers.io import broker, db
from workers.settings import ROOT, Settings

VECTORS = Path(digest.__file__).parent / "vectors"
DIGEST_VECTORS = json.loads((VECTORS / "digest.json").read_text())
IDENTITY_VECTORS = json.loads((VECTORS / "identity.json").read_text())
MAX = digest.MAX_SAFE_INTEGER
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-01$")
FIELDS = ("tenant", "operation_id", "attempt", "operation", "route", "owner", "binding")


def _create(name: str) -> str:
    admin_execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return database_url(name)


def _drop(name: str) -> None:
    admin_execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _migrate(url: str) -> None:
    settings = replace(Settings(), database_url=url)
    asyncio.run(provision.migrate(settings, participants=False))


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """An engine database as `custody db migrate` leaves it (schema.sql + commands.sql)."""
    name = f"custody_sqlcmd_{RUN}_{uuid.uuid4().hex[:6]}"
    url = _create(name)
    try:
        _migrate(url)
        yield url
    finally:
        _drop(name)


@pytest.fixture(scope="module")
def conn(database: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with psycopg.connect(database, autocommit=True, row_factory=dict_row) as c:
        yield c


def _one(c: psycopg.Connection[dict[str, Any]], query: Any, params: Any = None) -> Any:
    row = c.execute(query, params).fetchone()
    assert row is not None
    return next(iter(row.values()))


def _digest_args(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        **{k: fields[k] for k in FIELDS},
        "input": Jsonb(fields["input"]),
        "lineage": Jsonb(fields["lineage"]),
    }


SEMANTIC_DIGEST = (
    "SELECT custody.semantic_digest(%(tenant)s, %(operation_id)s, %(attempt)s, %(operation)s,"
    " %(route)s, %(owner)s, %(binding)s, %(input)s, %(lineage)s)"
)


# -- vectors -----------------------------------------------------------------------


@pytest.mark.parametrize("vector", DIGEST_VECTORS["vectors"], ids=lambda v: v["name"])
def test_sql_canonical_form_and_digest_equal_the_published_vectors(
    conn: psycopg.Connection[dict[str, Any]], vector: dict[str, Any]
) -> None:
    """The digest is computed from a canonical form that a participant in another
    language can compute: the SQL writes the vector's canonical bytes and its SHA-256."""
    f = vector["fields"]
    body = {
        "v": digest.DIGEST_VERSION,
        "tenant": f["tenant"],
        "operation_id": f["operation_id"],
        "attempt": f["attempt"],
        "operation": f["operation"],
        "target": {"route": f["route"], "owner": f["owner"], "binding": f["binding"]},
        "input": f["input"],
        "lineage": f["lineage"],
    }
    canonical = _one(conn, "SELECT convert_to(custody.canonical_json(%s), 'UTF8')", (Jsonb(body),))
    assert bytes(canonical) == vector["canonical"].encode("utf-8")
    assert _one(conn, SEMANTIC_DIGEST, _digest_args(f)) == vector["sha256"]


@pytest.mark.parametrize("refused", DIGEST_VECTORS["refused"], ids=lambda v: v["name"])
def test_sql_refuses_what_the_digest_domain_refuses(
    conn: psycopg.Connection[dict[str, Any]], refused: dict[str, Any]
) -> None:
    """Floats, integers outside ±(2**53-1), U+0000 and nesting deeper than 32 levels are
    outside the digest's domain in SQL too (U+0000 cannot even be a jsonb value)."""
    fields = {**DIGEST_VECTORS["vectors"][0]["fields"], "input": refused["input"]}
    with pytest.raises(digest.CanonicalFormError):
        digest.command_digest(**fields)
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(SEMANTIC_DIGEST, _digest_args(fields))
    expected = "22P05" if refused["name"].startswith("nul-") else "22023"
    assert caught.value.sqlstate == expected, caught.value


def test_nesting_limit_is_the_same_level_in_sql_and_python(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    """The depth limit counts the same levels: 32 is in the domain, 33 is not."""

    def nested(levels: int) -> dict[str, Any]:
        value: Any = []
        for _ in range(levels - 1):
            value = [value]
        return {"a": value}

    ok, deep = nested(32), nested(33)
    assert bytes(
        _one(conn, "SELECT convert_to(custody.canonical_json(%s), 'UTF8')", (Jsonb(ok),))
    ) == digest.canonical_bytes(ok)
    with pytest.raises(digest.CanonicalFormError):
        digest.canonical_bytes(deep)
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("SELECT custody.canonical_json(%s)", (Jsonb(deep),))
    assert caught.value.sqlstate == "22023"


def _identity_parts(vector: dict[str, Any]) -> list[str]:
    prefix = IDENTITY_VECTORS["prefixes"][vector["function"]]
    return [prefix, *(str(a) for a in vector["args"].values())]


@pytest.mark.parametrize(
    "vector", IDENTITY_VECTORS["vectors"], ids=lambda v: f"{v['function']}-{v['id'][:8]}"
)
def test_sql_identities_equal_the_published_vectors(
    conn: psycopg.Connection[dict[str, Any]], vector: dict[str, Any]
) -> None:
    """Identity is deterministic: uuid5 of the namespace and the '|'-joined parts, the
    same in SQL as in contracts/identity.py."""
    assert (
        str(_one(conn, "SELECT custody.derive_id(VARIADIC %s)", (_identity_parts(vector),)))
        == (vector["id"])
    )
    assert getattr(identity, vector["function"])(*vector["args"].values()) == vector["id"]
    if vector["function"] == "request_id":
        a = vector["args"]
        got = _one(
            conn,
            "SELECT custody.request_id(%s, %s, %s, %s)",
            (a["operation"], a["attempt"], a["kind"], a["sequence"]),
        )
        assert str(got) == vector["id"]
        if a["sequence"] == 1:  # the default is the first of its kind
            got = _one(
                conn,
                "SELECT custody.request_id(%s, %s, %s)",
                (a["operation"], a["attempt"], a["kind"]),
            )
            assert str(got) == vector["id"]


def test_derive_id_refuses_a_null_part(conn: psycopg.Connection[dict[str, Any]]) -> None:
    """A missing part is refused, never silently dropped from the name."""
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("SELECT custody.derive_id('request', NULL, '1')")
    assert caught.value.sqlstate == "22023"


# -- randomized equivalence --------------------------------------------------------

# code point ranges that exercise every escaping and ordering rule: controls, ASCII,
# DEL, two-byte, U+2028/U+2029, the rest of the BMP either side of the surrogates,
# U+FFFF, astral (four UTF-8 bytes, a surrogate pair in UTF-16)
RANGES = (
    (0x01, 0x1F),
    (0x20, 0x7E),
    (0x7F, 0x7F),
    (0x80, 0x7FF),
    (0x2028, 0x2029),
    (0x800, 0xD7FF),
    (0xE000, 0xFFFF),
    (0x10000, 0x10FFFF),
)
SPECIAL = '"\\/\b\f\n\r\t\x7f\u2028\u2029\ufeff\ufffe\uffff\U0001f600\U0010ffffaZ\u00e9'


def _char(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(SPECIAL)
    lo, hi = rng.choice(RANGES)
    return chr(rng.randint(lo, hi))


def _string(rng: random.Random, longest: int = 8) -> str:
    return "".join(_char(rng) for _ in range(rng.randint(0, longest)))


def _key(rng: random.Random, siblings: list[str]) -> str:
    if siblings and rng.random() < 0.4:  # a sibling's prefix: ordering of a prefix
        base = rng.choice(siblings)
        return base[: rng.randint(0, len(base))] + _string(rng, 2)
    return _string(rng, 6)


def _integer(rng: random.Random) -> int:
    return rng.choice(
        [0, -1, 1, MAX, -MAX, MAX - 1, rng.randint(-MAX, MAX), rng.randint(-1000, 1000)]
    )


def _value(rng: random.Random, depth: int) -> Any:
    r = rng.random()
    if depth >= 5 or r < 0.55:
        kind = rng.randrange(5)
        return [None, rng.random() < 0.5, _integer(rng), _string(rng), _string(rng, 20)][kind]
    if r < 0.75:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys: list[str] = []
    for _ in range(rng.randint(0, 6)):
        keys.append(_key(rng, keys))
    return {k: _value(rng, depth + 1) for k in keys}


def _canonical_in_sql(
    c: psycopg.Connection[dict[str, Any]], values: list[dict[str, Any]]
) -> list[bytes]:
    rows = c.execute(
        "SELECT convert_to(custody.canonical_json(v), 'UTF8') AS b"
        " FROM jsonb_array_elements(%s) WITH ORDINALITY AS e (v, i) ORDER BY i",
        (Jsonb(values),),
    ).fetchall()
    return [bytes(r["b"]) for r in rows]


def test_sql_canonical_form_equals_python_on_a_seeded_random_corpus(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    """The digest is computed from a canonical form that a participant in another
    language can compute: 4000 seeded random objects (controls, quotes, backslashes,
    DEL, U+2028, astral characters, shared key prefixes, boundary integers, nesting)
    give byte-identical canonical forms in SQL and in Python."""
    rng = random.Random(20240601)
    corpus = [_object(rng) for _ in range(4000)]
    expected = [digest.canonical_bytes(v) for v in corpus]
    got = _canonical_in_sql(conn, corpus)
    for value, want, have in zip(corpus, expected, got, strict=True):
        assert have == want, value


def test_sql_digest_equals_python_on_a_seeded_random_corpus(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    """Every field of the digest body takes part the same way in SQL and in Python
    (random strings in every text field, random attempts and lineage, random input)."""
    rng = random.Random(7)
    cases = []
    for _ in range(300):
        cases.append(
            {
                "tenant": _string(rng),
                "operation_id": str(uuid.UUID(int=rng.getrandbits(128), version=5)),
                "attempt": rng.randint(1, 10_000),
                "operation": _string(rng),
                "route": _string(rng),
                "owner": _string(rng),
                "binding": _string(rng),
                "input": _object(rng),
                "lineage": Lineage(
                    instance_id=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                    process=rng.choice(["order-fulfilment", "a", "p.q_r-9"]),
                    process_version=rng.randint(1, 2**31 - 1),
                    node=rng.choice(["reserve", "x", "n0.d-e_f"]),
                    activation=rng.randint(1, 2**31 - 1),
                ).model_dump(mode="json"),
            }
        )
    rows = conn.execute(
        "SELECT custody.semantic_digest(c->>'tenant', (c->>'operation_id')::uuid,"
        " (c->>'attempt')::int, c->>'operation', c->>'route', c->>'owner', c->>'binding',"
        " c->'input', c->'lineage') AS d"
        " FROM jsonb_array_elements(%s) WITH ORDINALITY AS e (c, i) ORDER BY i",
        (Jsonb(cases),),
    ).fetchall()
    for case, row in zip(cases, rows, strict=True):
        assert row["d"] == digest.command_digest(**case), case


_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-MAX, MAX) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=25,
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(value=st.dictionaries(_text, _json, max_size=6))
def test_sql_canonical_form_equals_python_for_any_value_in_the_domain(
    conn: psycopg.Connection[dict[str, Any]], value: dict[str, Any]
) -> None:
    """The canonical form in SQL is Python's for any JSON object in the digest's domain
    (property test over arbitrary Unicode, U+0000 and lone surrogates excluded)."""
    assert _canonical_in_sql(conn, [value]) == [digest.canonical_bytes(value)]


def test_database_is_utf8_and_c_collation_is_code_point_order(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    """Keys sort by Unicode code point: COLLATE "C" over UTF-8 bytes is that order
    (U+FFFF before U+1F600, unlike UTF-16; U+E000 after U+D7FF)."""
    assert _one(conn, "SELECT getdatabaseencoding()") == "UTF8"
    rng = random.Random(3)
    keys = sorted({_string(rng, 4) for _ in range(2000)} | {"\uffff", "\U0001f600", "\ue000"})
    got = conn.execute(
        'SELECT array_agg(k ORDER BY k COLLATE "C") AS a FROM unnest(%s::text[]) AS k', (keys,)
    ).fetchone()
    assert got is not None and got["a"] == sorted(keys)  # Python sorts str by code point


# -- real operation rows -----------------------------------------------------------


@pytest.fixture(scope="module")
def operations(database: str) -> list[dict[str, Any]]:
    """Operation rows made by the committer's own start path (commit_starts, real
    transaction and fence), with inputs that exercise the canonical form."""
    rng = random.Random(11)
    inputs = [
        {"order_id": "o-1001", "sku": "SKU-42", "quantity": 2},
        {
            "order_id": "Zo\u00eb \u00c5str\u00f6m \u6771\u4eac \U0001f600",
            "sku": "\u2028",
            "quantity": 0,
        },
        {
            "order_id": 'q"\\/\x01\x1f\x7f',
            "sku": {"\uffff": 1, "\U0001f600": 2, "z": [None, True, False], "Z": {}},
            "quantity": MAX,
        },
        {"order_id": -MAX, "sku": [[], {}, [[1]]], "quantity": {"": ""}},
        *(
            {"order_id": _string(rng), "sku": _object(rng), "quantity": _integer(rng)}
            for _ in range(12)
        ),
    ]
    return asyncio.run(_start(database, inputs))


async def _start(url: str, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    settings = replace(
        Settings(),
        database_url=url,
        routes_file=str(ROOT / "deploy" / "routes.toml"),
        processes_dir=str(ROOT / "deploy" / "processes"),
    )
    table, catalog = process.load_config(settings)
    database = db.Database(url, schema="custody", name="test-sql-commands")
    await database.open()
    try:
        lease = db.Lease("committer", ttl_s=60)
        await database.acquire(lease)
        c = committer.Committer(settings, database, lease, table, catalog)
        starts = []
        for i, payload in enumerate(inputs):
            request = StartRequest(
                tenant=["acme", "globex"][i % 2],
                start_request_id=str(uuid.uuid4()),
                process="order-fulfilment",
                input=payload,
                requested_by="test",
            )
            delivery = broker.Delivery(
                body=codec.encode(request),
                message_id=request.start_request_id,
                user_id="test",
                headers={"traceparent": tracing.new_traceparent()},
                redelivered=False,
                routing_key="",
                _message=None,  # type: ignore[arg-type]  # never acked here
            )
            starts.append((delivery, request))
        quarantine: list[dict[str, Any]] = []
        await c.commit_starts(starts, quarantine)
        assert quarantine == []
    finally:
        await database.close()
    async with await psycopg.AsyncConnection.connect(url, row_factory=dict_row) as a:
        cur = await a.execute("SELECT * FROM custody.operations ORDER BY created_at, id")
        rows = await cur.fetchall()
    assert len(rows) == len(inputs)
    return rows


def test_sql_digest_equals_the_stored_and_the_python_digest_of_real_operations(
    conn: psycopg.Connection[dict[str, Any]], operations: list[dict[str, Any]]
) -> None:
    """Same identity + same digest → the same command: custody.semantic_digest over a
    stored operation row is the digest the committer stored, which is the adapter's."""
    for row in operations:
        python = commands.Pinned.from_row(row).digest()
        sql_digest = _one(
            conn,
            "SELECT custody.semantic_digest(tenant, id, attempt, operation, route, owner,"
            " binding, input, lineage) FROM custody.operations WHERE id = %s",
            (row["id"],),
        )
        assert sql_digest == python == row["digest"]
        assert _one(conn, "SELECT custody.attempt_digest(%s, 1)", (row["id"],)) == row["digest"]
        assert _one(conn, "SELECT custody.attempt_digest(%s, 2)", (row["id"],)) == (
            commands.Pinned.from_row(row, attempt=2).digest()
        )


def test_stored_lineage_is_already_what_lineage_model_dump_makes_it(
    conn: psycopg.Connection[dict[str, Any]], operations: list[dict[str, Any]]
) -> None:
    """The lineage in the digest is Lineage.model_dump(mode="json"): exactly its five
    fields. The committer stores that dump, so validating and dumping a stored lineage
    changes nothing, and custody.lineage_v1 returns it unchanged."""
    for row in operations:
        dumped = Lineage.model_validate(row["lineage"], strict=False).model_dump(mode="json")
        assert dumped == row["lineage"]
        assert _one(conn, "SELECT custody.lineage_v1(%s)", (Jsonb(row["lineage"]),)) == dumped


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"extra": 1}, True),  # extra="forbid"
        ({"activation": 1.0}, False),  # an integral number: 1, as pydantic's lax int
        ({"process_version": 0}, True),  # Positive
        ({"process_version": 2**31}, True),  # int4
        ({"instance_id": "F2A0DFD5-029E-5D18-996D-31BCD242CC2B"}, True),  # canonical id
        ({"node": "Reserve"}, True),  # Name
        ({"process_version": "1"}, True),  # pydantic coerces; custody never stores it
    ],
)
def test_lineage_outside_the_stored_form_is_refused_or_normalised_like_python(
    conn: psycopg.Connection[dict[str, Any]], change: dict[str, Any], refused: bool
) -> None:
    """A lineage custody would not store is refused in SQL, not digested as it stands;
    an integral float is normalised to the integer, as Lineage does."""
    lineage = {**DIGEST_VECTORS["vectors"][0]["fields"]["lineage"], **change}
    if refused:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("SELECT custody.lineage_v1(%s)", (Jsonb(lineage),))
        assert caught.value.sqlstate == "22023"
        return
    python = Lineage.model_validate(lineage, strict=False).model_dump(mode="json")
    assert _one(conn, "SELECT custody.lineage_v1(%s)", (Jsonb(lineage),)) == python


# -- command bodies ----------------------------------------------------------------

REASON = "operator: " + "\u00e9\U0001f600x" * 900  # > 2000 code points, 4-byte ones too


def _python_rows(row: dict[str, Any], kind: str, sequence: int) -> commands.CommandRows:
    pinned = commands.Pinned.from_row(row)
    if kind == "submit":
        return commands.submit(pinned)
    if kind == "query":
        return commands.query(pinned, sequence=sequence)
    return commands.cancel(pinned, sequence=sequence, reason=REASON)


def _sql_body(c: psycopg.Connection[dict[str, Any]], op_id: Any, kind: str, sequence: int) -> bytes:
    reason = REASON if kind == "cancel" else None
    body = _one(
        c,
        "SELECT custody.command_body(o, %s, %s, %s) FROM custody.operations o WHERE o.id = %s",
        (kind, sequence, reason, op_id),
    )
    return bytes(body)


def _assert_same_command(sql_body: bytes, python_body: bytes, before: datetime) -> None:
    """Decoded as a participant decodes, equal but for issued_at (the database's now())."""
    theirs = codec.decode_command(sql_body)
    ours = codec.decode_command(python_body)
    assert type(theirs) is type(ours)
    assert before - timedelta(seconds=5) <= theirs.issued_at <= datetime.now(UTC)
    assert theirs.issued_at.utcoffset() == timedelta(0)
    assert theirs.model_copy(update={"issued_at": ours.issued_at}) == ours
    raw_theirs, raw_ours = orjson.loads(sql_body), orjson.loads(python_body)
    raw_theirs.pop("issued_at"), raw_ours.pop("issued_at")
    assert raw_theirs == raw_ours  # the same keys, "deadline": null included


@pytest.mark.parametrize(
    ("kind", "sequence"), [("submit", 1), ("query", 1), ("query", 3), ("cancel", 2)]
)
def test_command_bodies_decode_to_the_adapters_commands(
    conn: psycopg.Connection[dict[str, Any]],
    operations: list[dict[str, Any]],
    kind: str,
    sequence: int,
) -> None:
    """Recovery commands are the adapter's commands: the same immutable command identity
    (request id, digest, target, input, lineage, submit request id; a cancel's reason
    cut at 2000 code points), whichever side builds them."""
    before = datetime.now(UTC)
    for row in operations:
        python = _python_rows(row, kind, sequence)
        _assert_same_command(
            _sql_body(conn, row["id"], kind, sequence), python.outbox_row["body"], before
        )


def test_sql_body_is_the_canonical_json_of_the_command(
    conn: psycopg.Connection[dict[str, Any]], operations: list[dict[str, Any]]
) -> None:
    """The wire body is compact UTF-8 JSON a participant in another language can read:
    the canonical form of the command the adapter's codec would encode."""
    row = operations[2]
    body = _sql_body(conn, row["id"], "submit", 1)
    command = codec.decode_command(body)
    assert isinstance(command, SubmitCommand)
    assert body == digest.canonical_bytes(orjson.loads(codec.encode(command)))


# -- issuing -----------------------------------------------------------------------


def _issued(c: psycopg.Connection[dict[str, Any]], request: Any) -> tuple[Any, Any]:
    attempt = c.execute(
        "SELECT request_id, operation_id, attempt, kind, digest FROM custody.attempts"
        " WHERE request_id = %s",
        (request,),
    ).fetchone()
    outbox = c.execute(
        "SELECT id, kind, exchange, routing_key, body, headers, operation_id, status,"
        " publish_attempts, claimed_by FROM custody.outbox WHERE id = %s",
        (request,),
    ).fetchone()
    assert attempt is not None and outbox is not None
    return attempt, outbox


def _assert_rows_equal(
    attempt: dict[str, Any], outbox: dict[str, Any], python: commands.CommandRows, before: datetime
) -> None:
    assert {k: str(v) if isinstance(v, uuid.UUID) else v for k, v in attempt.items()} == (
        python.attempt_row
    )
    want = python.outbox_row
    got = {k: str(v) if isinstance(v, uuid.UUID) else v for k, v in outbox.items()}
    for column in ("id", "kind", "exchange", "routing_key", "operation_id"):
        assert got[column] == want[column], column
    assert (got["status"], got["publish_attempts"], got["claimed_by"]) == ("pending", 0, None)
    _assert_same_command(bytes(got["body"]), want["body"], before)
    assert set(got["headers"]) == set(want["headers"]) == {"traceparent"}
    traceparent = got["headers"]["traceparent"]
    assert TRACEPARENT.match(traceparent)
    assert tracing.from_headers(got["headers"]) == traceparent  # a valid W3C traceparent


def test_issue_command_writes_the_rows_the_adapter_describes(
    conn: psycopg.Connection[dict[str, Any]], operations: list[dict[str, Any]]
) -> None:
    """Every command, recovery ones included, leaves through the outbox: issue_command
    writes the attempts row and the outbox row commands._rows describes, under the
    operation row's lock, and returns the request id."""
    before = datetime.now(UTC)
    for row in operations[:6]:
        for kind, sequence in (("query", 1), ("query", 2), ("cancel", 1)):
            python = _python_rows(row, kind, sequence)
            with conn.transaction():
                conn.execute(
                    "SELECT 1 FROM custody.operations WHERE id = %s FOR UPDATE", (row["id"],)
                )
                reason = REASON if kind == "cancel" else None
                request = _one(
                    conn,
                    "SELECT custody.issue_command(%s, %s, %s, %s)",
                    (row["id"], kind, sequence, reason),
                )
            assert str(request) == python.request_id
            _assert_rows_equal(*_issued(conn, request), python, before)


def test_a_new_attempt_is_issued_with_the_new_attempts_digest(
    conn: psycopg.Connection[dict[str, Any]], operations: list[dict[str, Any]]
) -> None:
    """Attempt n+1 of the same operation and input is a new command identity, and the
    attempt is in the digest's domain: after the caller updates attempt and digest
    (custody.attempt_digest), the submit carries the new attempt's digest, as the
    adapter's new_attempt does; query and cancel then ask about that attempt."""
    before = datetime.now(UTC)
    for row in operations[6:10]:
        python = commands.submit(commands.Pinned.from_row(row, attempt=2))
        with conn.transaction():
            conn.execute("SELECT 1 FROM custody.operations WHERE id = %s FOR UPDATE", (row["id"],))
            conn.execute(
                "UPDATE custody.operations SET attempt = 2,"
                " digest = custody.attempt_digest(id, 2) WHERE id = %s",
                (row["id"],),
            )
            request = _one(conn, "SELECT custody.issue_command(%s, 'submit', 1)", (row["id"],))
        assert str(request) == python.request_id
        assert python.digest != row["digest"]
        _assert_rows_equal(*_issued(conn, request), python, before)
        bumped = {**row, "attempt": 2, "digest": python.digest}
        query = _python_rows(bumped, "query", 1)
        _assert_same_command(
            _sql_body(conn, row["id"], "query", 1), query.outbox_row["body"], before
        )


def test_a_submit_whose_stored_digest_is_another_attempts_is_refused(
    conn: psycopg.Connection[dict[str, Any]], operations: list[dict[str, Any]]
) -> None:
    """A caller that bumps the attempt but not the digest writes nothing: the command
    would bind the old attempt's digest to the new attempt's identity."""
    row = operations[10]
    with conn.transaction(force_rollback=True):
        conn.execute("UPDATE custody.operations SET attempt = 2 WHERE id = %s", (row["id"],))
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("SELECT custody.issue_command(%s, 'submit', 1)", (row["id"],))
    assert caught.value.sqlstate == "22000"
    assert _one(conn, "SELECT attempt FROM custody.operations WHERE id = %s", (row["id"],)) == 1
    assert (
        _one(conn, "SELECT count(*) FROM custody.attempts WHERE operation_id = %s", (row["id"],))
        == 1
    )


@pytest.mark.parametrize(
    ("kind", "sequence", "reason", "sqlstate"),
    [
        ("retry", 1, None, "22023"),
        ("submit", 2, None, "22023"),
        ("query", 0, None, "22023"),
        ("cancel", 1, None, "22023"),
        ("query", 1, "why", "22023"),
    ],
)
def test_issue_command_refuses_what_the_adapter_cannot_build(
    conn: psycopg.Connection[dict[str, Any]],
    operations: list[dict[str, Any]],
    kind: str,
    sequence: int,
    reason: str | None,
    sqlstate: str,
) -> None:
    """Only submit, query and cancel exist; a submit is the first of its kind; a cancel,
    and only a cancel, has a reason. A refusal writes nothing."""
    row = operations[11]
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(
            "SELECT custody.issue_command(%s, %s, %s, %s)", (row["id"], kind, sequence, reason)
        )
    assert caught.value.sqlstate == sqlstate
    assert (
        _one(conn, "SELECT count(*) FROM custody.outbox WHERE operation_id = %s", (row["id"],)) == 1
    )


def test_issue_command_for_a_missing_operation_is_refused(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    """No operation, no command."""
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("SELECT custody.issue_command(%s, 'query', 1)", (uuid.uuid4(),))
    assert caught.value.sqlstate == "P0002"


# -- migration ---------------------------------------------------------------------


def test_commands_sql_is_idempotent_and_uses_uuid_ossp_where_it_already_lives() -> None:
    """`custody db migrate` may run again, and on a database whose uuid-ossp is already
    installed in another schema: derive_id then calls that one (no second copy)."""
    name = f"custody_sqlcmd_{RUN}_ext_{uuid.uuid4().hex[:6]}"
    url = _create(name)
    try:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute('CREATE EXTENSION "uuid-ossp" WITH SCHEMA public')
        _migrate(url)
        _migrate(url)
        vector = IDENTITY_VECTORS["vectors"][0]
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
            got = _one(c, "SELECT custody.derive_id(VARIADIC %s)", (_identity_parts(vector),))
            assert str(got) == vector["id"]
            schemas = c.execute(
                "SELECT n.nspname FROM pg_extension e"
                " JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'uuid-ossp'"
            ).fetchall()
            assert [r["nspname"] for r in schemas] == ["public"]
    finally:
        _drop(name)
