-- custody executor commands in SQL: the pure building blocks of the operator recovery
-- functions (SECURITY DEFINER, so that an operator role cannot hand-edit rows). They
-- build the same commands workers/core/commands.py builds: same identities (contracts/
-- identity.py), same semantic digest (contracts/digest.py, custody.digest.v1), same
-- attempts and outbox rows. tests/integration/test_sql_commands.py holds them equal to
-- the Python, vectors (contracts/vectors/) and a randomized corpus included.
--
-- Applied right after schema.sql by `custody db migrate` (idempotent: CREATE OR
-- REPLACE; serialised by the migration's advisory lock). Every object is qualified
-- with its schema, so a SECURITY DEFINER caller's search_path cannot redirect a call.
--
-- Refusals: 22023 (invalid_parameter_value) for a value outside the digest's domain or
-- an argument the adapter would not accept; P0002 (no_data_found) for a missing
-- operation; 22000 (data_exception) for an operation row whose stored digest is not
-- its current attempt's.

-- The canonical form is UTF-8 and sorts keys by code point with COLLATE "C", which
-- compares the database's bytes: both hold only if the database encoding is UTF-8.
DO $$
BEGIN
  IF pg_catalog.getdatabaseencoding() <> 'UTF8' THEN
    RAISE EXCEPTION 'custody needs a UTF8 database, not %', pg_catalog.getdatabaseencoding()
      USING ERRCODE = '22023';
  END IF;
END $$;

-- Identities ---------------------------------------------------------------------
-- RFC 4122 version-5 UUIDs need SHA-1, which core Postgres lacks: uuid-ossp's
-- uuid_generate_v5 (a trusted extension). Installed into custody unless the database
-- already has it elsewhere; derive_id is written against whichever schema holds it.
DO $$
DECLARE
  ext_schema text;
BEGIN
  SELECT n.nspname INTO ext_schema
    FROM pg_catalog.pg_extension e
    JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
   WHERE e.extname = 'uuid-ossp';
  IF ext_schema IS NULL THEN
    CREATE EXTENSION IF NOT EXISTS "uuid-ossp" WITH SCHEMA custody;
    ext_schema := 'custody';
  END IF;
  -- identity._derive: uuid5(NAMESPACE, '|'.join(parts)). A NULL part is refused (Python
  -- would write 'None'; array_to_string would silently drop it).
  EXECUTE format($fn$
    CREATE OR REPLACE FUNCTION custody.derive_id(VARIADIC parts text[]) RETURNS uuid
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $body$
    BEGIN
      IF pg_catalog.array_position(parts, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'custody.derive_id: a part is NULL (%%)', parts
          USING ERRCODE = '22023';
      END IF;
      RETURN %I.uuid_generate_v5('6f6b9d8e-2a55-4c1e-9a51-637573746f64'::uuid,
                                 pg_catalog.array_to_string(parts, '|'));
    END $body$
  $fn$, ext_schema);
END $$;

-- identity.request_id: the request id of (operation, attempt, kind, sequence).
CREATE OR REPLACE FUNCTION custody.request_id(
  operation uuid, attempt integer, kind text, sequence integer DEFAULT 1
) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT custody.derive_id('request', operation::text, attempt::text, kind, sequence::text)
$$;

-- Canonical form (custody.digest.v1) ---------------------------------------------
-- Object keys sorted by code point (COLLATE "C" compares the UTF-8 bytes, and UTF-8
-- byte order is code point order), no white space, strings escaped as jsonb's own
-- output escapes them (the same escapes as the Python encoder: \" \\ \b \f \n \r \t,
-- other U+0001..U+001F as \u00xx lowercase, everything else — '/', DEL, U+2028,
-- non-ASCII — as itself), integers as digits. Refused as digest.check_json_value
-- refuses: a number with a fraction part (psycopg reads it as a float), an integer
-- outside ±(2**53-1), nesting deeper than 32 levels. (U+0000 and lone surrogates
-- cannot be in a jsonb value at all.)
CREATE OR REPLACE FUNCTION custody.canonical_json_at(v jsonb, depth integer) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
  n numeric;
BEGIN
  IF depth > 32 THEN
    RAISE EXCEPTION 'canonical form: nested deeper than 32 levels' USING ERRCODE = '22023';
  END IF;
  CASE pg_catalog.jsonb_typeof(v)
    WHEN 'object' THEN
      RETURN '{' || coalesce((
        SELECT pg_catalog.string_agg(
                 pg_catalog.to_jsonb(e.key)::text || ':'
                   || custody.canonical_json_at(e.value, depth + 1),
                 ',' ORDER BY e.key COLLATE "C")
          FROM pg_catalog.jsonb_each(v) AS e), '') || '}';
    WHEN 'array' THEN
      RETURN '[' || coalesce((
        SELECT pg_catalog.string_agg(custody.canonical_json_at(a.value, depth + 1), ','
                                     ORDER BY a.ord)
          FROM pg_catalog.jsonb_array_elements(v) WITH ORDINALITY AS a (value, ord)), '')
        || ']';
    WHEN 'number' THEN
      n := v::numeric;
      IF pg_catalog.scale(n) <> 0 THEN
        RAISE EXCEPTION 'canonical form: % is not an integer; floats are not allowed, send decimals as strings', n
          USING ERRCODE = '22023';
      END IF;
      IF pg_catalog.abs(n) > 9007199254740991 THEN
        RAISE EXCEPTION 'canonical form: % is outside the interoperable range ±(2**53-1)', n
          USING ERRCODE = '22023';
      END IF;
      RETURN n::text;
    ELSE
      -- string, boolean, null: jsonb writes these exactly as the canonical form does
      RETURN v::text;
  END CASE;
END $$;

CREATE OR REPLACE FUNCTION custody.canonical_json(v jsonb) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT custody.canonical_json_at(v, 0)
$$;

-- The lineage as SubmitCommand digests it: Lineage.model_validate(…, strict=False)
-- .model_dump(mode="json"), i.e. exactly the five fields, validated. custody stores
-- that very dump (committer.plan_activation), so for every stored lineage this is the
-- identity. Anything else is refused rather than coerced (Python would also coerce
-- strings such as "1" or "1_0" and booleans to integers; custody never stores those);
-- an integral number written with a fraction (1.0) becomes 1, as in Python.
CREATE OR REPLACE FUNCTION custody.lineage_v1(lineage jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
  name_pattern constant text := '^[a-z0-9][a-z0-9_.-]{0,62}$';
  keys text[];
  f text;
  n numeric;
  ints jsonb := '{}';
BEGIN
  IF pg_catalog.jsonb_typeof(lineage) <> 'object' THEN
    RAISE EXCEPTION 'lineage: not an object' USING ERRCODE = '22023';
  END IF;
  SELECT pg_catalog.array_agg(k ORDER BY k COLLATE "C") INTO keys
    FROM pg_catalog.jsonb_object_keys(lineage) AS k;
  IF keys IS DISTINCT FROM
     ARRAY['activation', 'instance_id', 'node', 'process', 'process_version'] THEN
    RAISE EXCEPTION 'lineage: keys % are not instance_id, process, process_version, node, activation', keys
      USING ERRCODE = '22023';
  END IF;
  IF pg_catalog.jsonb_typeof(lineage -> 'instance_id') <> 'string'
     OR (lineage ->> 'instance_id')
        !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
    RAISE EXCEPTION 'lineage: instance_id % is not a canonical id', lineage -> 'instance_id'
      USING ERRCODE = '22023';
  END IF;
  FOREACH f IN ARRAY ARRAY['process', 'node'] LOOP
    IF pg_catalog.jsonb_typeof(lineage -> f) <> 'string' OR (lineage ->> f) !~ name_pattern THEN
      RAISE EXCEPTION 'lineage: % % is not a name', f, lineage -> f USING ERRCODE = '22023';
    END IF;
  END LOOP;
  FOREACH f IN ARRAY ARRAY['process_version', 'activation'] LOOP
    IF pg_catalog.jsonb_typeof(lineage -> f) <> 'number' THEN
      RAISE EXCEPTION 'lineage: % % is not a number', f, lineage -> f USING ERRCODE = '22023';
    END IF;
    n := (lineage -> f)::numeric;
    IF n <> pg_catalog.trunc(n) OR n < 1 OR n > 2147483647 THEN
      RAISE EXCEPTION 'lineage: % % is not a positive int4', f, n USING ERRCODE = '22023';
    END IF;
    ints := ints || pg_catalog.jsonb_build_object(f, n::integer);
  END LOOP;
  RETURN pg_catalog.jsonb_build_object(
    'instance_id', lineage -> 'instance_id',
    'process', lineage -> 'process',
    'process_version', ints -> 'process_version',
    'node', lineage -> 'node',
    'activation', ints -> 'activation');
END $$;

-- The semantic digest ------------------------------------------------------------
-- SubmitCommand.semantic_digest() = digest.command_digest(...) with the lineage as
-- Lineage dumps it: lowercase hex SHA-256 of the canonical UTF-8 bytes of
-- {"v", "tenant", "operation_id", "attempt", "operation", "target": {"route", "owner",
-- "binding"}, "input", "lineage"}.
CREATE OR REPLACE FUNCTION custody.semantic_digest(
  tenant text, operation_id uuid, attempt integer, operation text, route text, owner text,
  binding text, input jsonb, lineage jsonb
) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
  IF tenant IS NULL OR operation_id IS NULL OR attempt IS NULL OR operation IS NULL
     OR route IS NULL OR owner IS NULL OR binding IS NULL OR input IS NULL
     OR lineage IS NULL THEN
    RAISE EXCEPTION 'custody.semantic_digest: every field is required' USING ERRCODE = '22023';
  END IF;
  IF pg_catalog.jsonb_typeof(input) <> 'object' THEN
    RAISE EXCEPTION 'custody.semantic_digest: input is not an object' USING ERRCODE = '22023';
  END IF;
  RETURN pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(custody.canonical_json(
    pg_catalog.jsonb_build_object(
      'v', 'custody.digest.v1',
      'tenant', tenant,
      'operation_id', operation_id::text,
      'attempt', attempt,
      'operation', operation,
      'target', pg_catalog.jsonb_build_object('route', route, 'owner', owner, 'binding', binding),
      'input', input,
      'lineage', custody.lineage_v1(lineage))), 'UTF8')), 'hex');
END $$;

-- The digest of attempt ``attempt`` of an operation (same operation and input, another
-- attempt: attempt is in the digest's domain). For a new attempt, the caller computes
-- it before its UPDATE of operations.attempt and operations.digest.
CREATE OR REPLACE FUNCTION custody.attempt_digest(op_id uuid, attempt integer) RETURNS text
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
  op custody.operations;
BEGIN
  SELECT * INTO op FROM custody.operations AS o WHERE o.id = op_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no operation %', op_id USING ERRCODE = 'P0002';
  END IF;
  RETURN custody.semantic_digest(op.tenant, op.id, attempt_digest.attempt, op.operation,
                                 op.route, op.owner, op.binding, op.input, op.lineage);
END $$;

-- Commands -----------------------------------------------------------------------
-- A W3C traceparent for a new trace (tracing.new_traceparent: the adapter's commands
-- from operator paths have no parent): 16 random bytes of trace id, 8 of span id.
CREATE OR REPLACE FUNCTION custody.new_traceparent() RETURNS text
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT '00-' || pg_catalog.substr(h, 1, 32) || '-' || pg_catalog.substr(h, 33, 16) || '-01'
    FROM (SELECT pg_catalog.encode(pg_catalog.sha256(
                   pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                   || pg_catalog.uuid_send(pg_catalog.gen_random_uuid())), 'hex') AS h) AS r
$$;

-- The wire body of adapter.submit / query / cancel for the operation row ``op`` (its
-- current attempt): the canonical JSON of the command's model_dump(mode="json"), which
-- codec.decode_command (what a participant decodes with) reads back into the model the
-- adapter builds, issued_at (now()) apart. The digest is the row's stored digest, which
-- must be its current attempt's: the caller of a new attempt updates attempt and digest
-- (custody.attempt_digest) together first, as operation_new_attempt does.
CREATE OR REPLACE FUNCTION custody.command_body(
  op custody.operations, kind text, sequence integer, reason text DEFAULT NULL
) RETURNS bytea
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
  recomputed text;
  body jsonb;
BEGIN
  IF op.id IS NULL THEN
    RAISE EXCEPTION 'custody.command_body: no operation row' USING ERRCODE = '22023';
  END IF;
  IF kind IS NULL OR kind NOT IN ('submit', 'query', 'cancel') THEN
    RAISE EXCEPTION 'custody.command_body: kind % is not submit, query or cancel', kind
      USING ERRCODE = '22023';
  END IF;
  IF sequence IS NULL OR sequence < 1 OR (kind = 'submit' AND sequence <> 1) THEN
    RAISE EXCEPTION 'custody.command_body: sequence % for a % (a submit is always 1)',
      sequence, kind USING ERRCODE = '22023';
  END IF;
  IF (kind = 'cancel') <> (reason IS NOT NULL) THEN
    RAISE EXCEPTION 'custody.command_body: a cancel, and only a cancel, has a reason'
      USING ERRCODE = '22023';
  END IF;
  IF op.attempt IS NULL OR op.attempt NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'custody.command_body: attempt % outside 1..10000', op.attempt
      USING ERRCODE = '22023';
  END IF;
  recomputed := custody.semantic_digest(op.tenant, op.id, op.attempt, op.operation, op.route,
                                        op.owner, op.binding, op.input, op.lineage);
  IF op.digest IS DISTINCT FROM recomputed THEN
    RAISE EXCEPTION 'operation %: stored digest % is not attempt %''s digest %',
      op.id, op.digest, op.attempt, recomputed USING ERRCODE = '22000';
  END IF;
  body := pg_catalog.jsonb_build_object(
    'type', 'custody.command.' || kind || '.v1',
    'request_id', custody.request_id(op.id, op.attempt, kind, sequence)::text,
    'tenant', op.tenant,
    'operation_id', op.id::text,
    'attempt', op.attempt,
    'operation', op.operation,
    'target', pg_catalog.jsonb_build_object(
      'route', op.route, 'owner', op.owner, 'binding', op.binding),
    'digest', op.digest,
    'issued_at', pg_catalog.to_char(pg_catalog.now() AT TIME ZONE 'UTC',
                                    'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'));
  IF kind = 'submit' THEN
    body := body || pg_catalog.jsonb_build_object(
      'input', op.input, 'lineage', custody.lineage_v1(op.lineage), 'deadline', NULL);
  ELSE
    body := body || pg_catalog.jsonb_build_object(
      'submit_request_id', custody.request_id(op.id, op.attempt, 'submit', 1)::text);
    IF kind = 'cancel' THEN
      body := body || pg_catalog.jsonb_build_object('reason', pg_catalog.left(reason, 2000));
    END IF;
  END IF;
  RETURN pg_catalog.convert_to(custody.canonical_json(body), 'UTF8');
END $$;

-- Issue one command: the rows adapter._rows describes (the issued identity in
-- attempts, the dispatch intent in outbox, whose publisher sends it like any other),
-- for the operation's current attempt; returns the request id. The caller holds the
-- operation row's lock (FOR UPDATE) and, for a new attempt, has already updated attempt
-- and digest. Runs with the caller's rights.
CREATE OR REPLACE FUNCTION custody.issue_command(
  op_id uuid, kind text, sequence integer, reason text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  op custody.operations;
  body bytea;
  request uuid;
BEGIN
  SELECT * INTO op FROM custody.operations AS o WHERE o.id = op_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no operation %', op_id USING ERRCODE = 'P0002';
  END IF;
  body := custody.command_body(op, kind, sequence, reason);
  request := custody.request_id(op.id, op.attempt, kind, sequence);
  INSERT INTO custody.attempts (request_id, operation_id, attempt, kind, digest)
  VALUES (request, op.id, op.attempt, kind, op.digest);
  INSERT INTO custody.outbox (id, kind, exchange, routing_key, body, headers, operation_id)
  VALUES (request, kind, 'custody.commands', op.binding, body,
          pg_catalog.jsonb_build_object('traceparent', custody.new_traceparent()), op.id);
  RETURN request;
END $$;
