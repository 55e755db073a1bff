-- The participant runtime's tables, created in the participant's own schema (the
-- connection's search_path names it) in the participant's own database. Identical
-- outbox columns to the engine's, so one publisher serves both.

CREATE TABLE IF NOT EXISTS inbox (
  request_id     uuid PRIMARY KEY,
  tenant         text NOT NULL,
  operation_id   uuid NOT NULL,
  attempt        integer NOT NULL,
  operation      text NOT NULL,
  digest         text NOT NULL,
  command        jsonb NOT NULL,
  status         text NOT NULL CHECK (status IN ('accepted', 'succeeded', 'failed', 'cancelled', 'rejected')),
  effect         text NOT NULL CHECK (effect IN ('none', 'applied', 'unknown')),
  owner_revision integer NOT NULL,
  result         jsonb,
  error          jsonb,
  accepted_at    timestamptz NOT NULL DEFAULT now(),
  completed_at   timestamptz,
  claimed_until  timestamptz,
  executions     integer NOT NULL DEFAULT 0,
  traceparent    text
);
CREATE INDEX IF NOT EXISTS inbox_open ON inbox (accepted_at) WHERE status = 'accepted';
CREATE INDEX IF NOT EXISTS inbox_operation ON inbox (operation_id, attempt);

-- A cancel that arrived before its command: the late command is refused.
CREATE TABLE IF NOT EXISTS tombstones (
  request_id   uuid PRIMARY KEY,
  tenant       text NOT NULL,
  operation_id uuid NOT NULL,
  reason       text NOT NULL,
  created_at   timestamptz NOT NULL DEFAULT now()
);

-- Same identity, different digest: recorded, never executed.
CREATE TABLE IF NOT EXISTS conflicts (
  id              bigserial PRIMARY KEY,
  request_id      uuid NOT NULL,
  stored_digest   text NOT NULL,
  received_digest text NOT NULL,
  command         jsonb NOT NULL,
  created_at      timestamptz NOT NULL DEFAULT now()
);

-- Every receipt the participant issued, by revision: the journal that answers queries.
CREATE TABLE IF NOT EXISTS receipts (
  receipt_id     uuid PRIMARY KEY,
  request_id     uuid NOT NULL,
  owner_revision integer NOT NULL,
  body           bytea NOT NULL,
  created_at     timestamptz NOT NULL DEFAULT now(),
  UNIQUE (request_id, owner_revision)
);

-- Commands refused before acceptance (bad bytes, wrong owner): kept with a reason.
CREATE TABLE IF NOT EXISTS refused (
  id          bigserial PRIMARY KEY,
  reason      text NOT NULL,
  detail      text NOT NULL,
  message_id  text,
  body        bytea NOT NULL,
  received_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS outbox (
  id               uuid PRIMARY KEY,
  exchange         text NOT NULL,
  routing_key      text NOT NULL,
  body             bytea NOT NULL,
  headers          jsonb NOT NULL DEFAULT '{}',
  operation_id     uuid,
  status           text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'published')),
  claimed_by       text,
  claim_expires_at timestamptz,
  publish_attempts integer NOT NULL DEFAULT 0,
  next_attempt_at  timestamptz NOT NULL DEFAULT now(),
  last_error       text,
  created_at       timestamptz NOT NULL DEFAULT now(),
  published_at     timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (next_attempt_at) WHERE status = 'pending';
-- The pending rows as the outbox gauges read them (outbox_stats, shared with the engine,
-- whose view of the same name marks the submits a dispatch pause holds): a
-- participant's outbox holds nothing back.
CREATE OR REPLACE VIEW outbox_pending_rows AS
SELECT id, created_at, false AS held FROM outbox WHERE status = 'pending';
-- Retention (p_retention_inbox, retention_outbox) reaches the settled rows through
-- their time column, never by reading the journal in full (tests/integration/
-- test_query_plans.py).
CREATE INDEX IF NOT EXISTS inbox_settled ON inbox (completed_at) WHERE status <> 'accepted';
CREATE INDEX IF NOT EXISTS outbox_published ON outbox (published_at) WHERE status = 'published';

-- Added after the first release: kept idempotent for existing participant schemas.
ALTER TABLE inbox ADD COLUMN IF NOT EXISTS traceparent text;

-- The executor's claim: set in a short transaction, re-checked by each handler's own
-- transaction (acceptance never waits behind execution).
ALTER TABLE inbox ADD COLUMN IF NOT EXISTS claim_token uuid;

-- A statement guarded by the status it read its rows with raises this when it changed
-- fewer rows than it was given (CU004, the engine's twin in transitions.sql): the unit
-- is redone, re-reading everything, without the caller waiting for the row count.
CREATE OR REPLACE FUNCTION changed_under_lock(p_what text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION '% changed under its row lock', p_what USING ERRCODE = 'CU004';
END $$;
