-- Migration 0001, the baseline: the engine schema as schema.sql had it when versioned
-- migrations came (it is still idempotent, as it was written then). With the migrations
-- after it, the truth: Python enums are tested against these types. Applied once by
-- `custody db migrate` (recorded in custody.schema_migrations, under an advisory lock),
-- never as a side effect of a worker starting. Never edit an applied migration: add
-- migrations/NNNN_name.sql (README, "Schema migrations").

CREATE SCHEMA IF NOT EXISTS custody;

DO $$ BEGIN
  CREATE TYPE custody.operation_status AS ENUM (
    'pending', 'dispatched', 'accepted', 'succeeded', 'failed', 'retry_waiting',
    'outcome_unknown', 'reconcile_pending', 'cancelling', 'cancelled');
EXCEPTION WHEN duplicate_object THEN NULL; END $$;

DO $$ BEGIN
  CREATE TYPE custody.effect AS ENUM ('none', 'applied', 'unknown');
EXCEPTION WHEN duplicate_object THEN NULL; END $$;

DO $$ BEGIN
  CREATE TYPE custody.instance_status AS ENUM (
    'running', 'suspended', 'cancelling', 'cancelled', 'completed', 'failed');
EXCEPTION WHEN duplicate_object THEN NULL; END $$;

-- One row: global switches. dispatch_paused stops the outbox publisher from
-- publishing commands (restore runbook); restore_generation is bumped by a restore.
CREATE TABLE IF NOT EXISTS custody.control (
  singleton          boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  dispatch_paused    boolean NOT NULL DEFAULT false,
  restore_generation integer NOT NULL DEFAULT 1,
  updated_at         timestamptz NOT NULL DEFAULT now()
);
INSERT INTO custody.control (singleton) VALUES (true) ON CONFLICT DO NOTHING;

-- Worker leases: every engine commit checks its holder's epoch and expiry inside
-- its own transaction (fencing); time is the database's, never the worker's clock.
CREATE TABLE IF NOT EXISTS custody.leases (
  holder      text PRIMARY KEY,
  worker      text NOT NULL,
  epoch       bigint NOT NULL,
  acquired_at timestamptz NOT NULL DEFAULT now(),
  expires_at  timestamptz NOT NULL
);
-- the last heartbeat (lease_renew), for `custody workers list`; added by an idempotent
-- change so that a database of an earlier release gets it from `custody db migrate`
ALTER TABLE custody.leases ADD COLUMN IF NOT EXISTS renewed_at timestamptz;

CREATE TABLE IF NOT EXISTS custody.instances (
  id               uuid PRIMARY KEY,
  tenant           text NOT NULL,
  start_request_id uuid NOT NULL,
  process          text NOT NULL,
  process_version  integer NOT NULL,
  input            jsonb NOT NULL,
  status           custody.instance_status NOT NULL,
  requested_by     text NOT NULL,
  traceparent      text,
  routes           jsonb NOT NULL,
  dispatch_paused  boolean NOT NULL DEFAULT false,
  created_at       timestamptz NOT NULL DEFAULT now(),
  updated_at       timestamptz NOT NULL DEFAULT now(),
  finished_at      timestamptz,
  UNIQUE (tenant, start_request_id)
);
CREATE INDEX IF NOT EXISTS instances_status ON custody.instances (status)
  WHERE status NOT IN ('completed', 'failed', 'cancelled');
-- the reconciler's gauge of paused instances (dispatch_stats), sampled on every poll
CREATE INDEX IF NOT EXISTS instances_dispatch_paused ON custody.instances (status)
  WHERE dispatch_paused;

-- An authorized cancellation of a start request that has not created its instance
-- (yet): the late start creates nothing. Checked under the same advisory lock as the
-- start, so exactly one of the two wins.
CREATE TABLE IF NOT EXISTS custody.start_tombstones (
  tenant           text NOT NULL,
  start_request_id uuid NOT NULL,
  actor            text NOT NULL,
  reason           text NOT NULL,
  created_at       timestamptz NOT NULL DEFAULT now(),
  late_start_at    timestamptz,
  PRIMARY KEY (tenant, start_request_id)
);

-- Node activations of an instance. (instance, node, activation) is the lineage that
-- the operation id is derived from.
CREATE TABLE IF NOT EXISTS custody.node_states (
  instance_id  uuid NOT NULL REFERENCES custody.instances (id),
  node         text NOT NULL,
  activation   integer NOT NULL,
  operation_id uuid NOT NULL,
  status       text NOT NULL,
  created_at   timestamptz NOT NULL DEFAULT now(),
  updated_at   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (instance_id, node, activation)
);

CREATE INDEX IF NOT EXISTS node_states_operation ON custody.node_states (operation_id);

CREATE TABLE IF NOT EXISTS custody.history (
  id           bigserial PRIMARY KEY,
  instance_id  uuid NOT NULL,
  operation_id uuid,
  event        text NOT NULL,
  detail       jsonb NOT NULL DEFAULT '{}',
  actor        text NOT NULL,
  at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS history_instance ON custody.history (instance_id, id);

-- An operation pins its route, owner, principal and binding at creation: later
-- configuration never redirects it.
CREATE TABLE IF NOT EXISTS custody.operations (
  id              uuid PRIMARY KEY,
  tenant          text NOT NULL,
  instance_id     uuid NOT NULL REFERENCES custody.instances (id),
  node            text NOT NULL,
  activation      integer NOT NULL,
  operation       text NOT NULL,
  route           text NOT NULL,
  owner           text NOT NULL,
  principal       text NOT NULL,
  binding         text NOT NULL,
  input           jsonb NOT NULL,
  lineage         jsonb NOT NULL,
  attempt         integer NOT NULL,
  digest          text NOT NULL,
  status          custody.operation_status NOT NULL,
  effect          custody.effect NOT NULL DEFAULT 'unknown',
  owner_revision  integer NOT NULL DEFAULT 0,
  receipt_hash    text,
  result          jsonb,
  error           jsonb,
  deadline_seconds integer NOT NULL,
  deadline_at     timestamptz,
  retry_at        timestamptz,
  created_at      timestamptz NOT NULL DEFAULT now(),
  updated_at      timestamptz NOT NULL DEFAULT now(),
  finished_at     timestamptz,
  UNIQUE (instance_id, node, activation)
);
CREATE INDEX IF NOT EXISTS operations_open ON custody.operations (status, deadline_at)
  WHERE status NOT IN ('succeeded', 'failed', 'cancelled');
CREATE INDEX IF NOT EXISTS operations_instance ON custody.operations (instance_id);

-- Every command identity the engine issued: attempt, kind and the digest it binds.
CREATE TABLE IF NOT EXISTS custody.attempts (
  request_id   uuid PRIMARY KEY,
  operation_id uuid NOT NULL REFERENCES custody.operations (id),
  attempt      integer NOT NULL,
  kind         text NOT NULL CHECK (kind IN ('submit', 'query', 'cancel')),
  digest       text NOT NULL,
  created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS attempts_operation ON custody.attempts (operation_id, attempt);

-- Dispatch intent. id is the command's request id and the AMQP message_id, so a
-- re-created transition yields the same message, which the participant deduplicates.
CREATE TABLE IF NOT EXISTS custody.outbox (
  id               uuid PRIMARY KEY,
  kind             text NOT NULL CHECK (kind IN ('submit', 'query', 'cancel')),
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
CREATE INDEX IF NOT EXISTS outbox_pending ON custody.outbox (next_attempt_at)
  WHERE status = 'pending';
-- The pending rows, each saying whether it is *held*: a submit that waits on purpose,
-- because dispatch is paused (globally, or for its instance) or its instance is not
-- running (suspended). outbox_claim (queries.sql) sends no such submit; the outbox
-- gauges count only the rows not held (a deliberate pause is not a stuck outbox) and
-- the reconciler counts the held ones (custody_dispatch_held_submits).
-- participant_schema.sql has the same view, where nothing is ever held.
-- (Per pending row, by primary key: never a scan of operations or instances, which
-- grow with the traffic; tests/integration/test_query_plans.py.)
CREATE OR REPLACE VIEW custody.outbox_pending_rows AS
SELECT o.id, o.kind, o.created_at,
       (o.kind = 'submit'
        AND ((SELECT c.dispatch_paused FROM custody.control c)
             OR coalesce((SELECT i.dispatch_paused OR i.status <> 'running'
                            FROM custody.operations op
                            JOIN custody.instances i ON i.id = op.instance_id
                           WHERE op.id = o.operation_id), false))) AS held
  FROM custody.outbox o
 WHERE o.status = 'pending';

-- Exactly-once receipt application: a receipt id changes engine state at most once.
CREATE TABLE IF NOT EXISTS custody.receipt_inbox (
  receipt_id     uuid PRIMARY KEY,
  operation_id   uuid NOT NULL,
  attempt        integer NOT NULL,
  owner_revision integer NOT NULL,
  status         text NOT NULL,
  content_hash   text NOT NULL,
  decision       text NOT NULL,
  received_at    timestamptz NOT NULL DEFAULT now()
);

-- Next-step intent, written with the validated result that caused it; at most one
-- per finished operation.
CREATE TABLE IF NOT EXISTS custody.successor_intents (
  id                bigserial PRIMARY KEY,
  instance_id       uuid NOT NULL,
  from_operation_id uuid NOT NULL UNIQUE,
  outcome           text NOT NULL,
  next_node         text,
  status            text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done')),
  created_at        timestamptz NOT NULL DEFAULT now(),
  done_at           timestamptz
);
CREATE INDEX IF NOT EXISTS successor_intents_pending ON custody.successor_intents (id)
  WHERE status = 'pending';

-- Messages refused at the trust boundary, with a machine-readable reason.
CREATE TABLE IF NOT EXISTS custody.quarantine (
  id           bigserial PRIMARY KEY,
  source       text NOT NULL,
  reason       text NOT NULL,
  detail       text NOT NULL,
  message_id   text,
  user_id      text,
  tenant       text,
  operation_id uuid,
  body         bytea NOT NULL,
  headers      jsonb NOT NULL DEFAULT '{}',
  worker       text NOT NULL,
  received_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS quarantine_reason ON custody.quarantine (reason, received_at);

CREATE TABLE IF NOT EXISTS custody.audit (
  id      bigserial PRIMARY KEY,
  actor   text NOT NULL,
  action  text NOT NULL,
  tenant  text,
  target  text,
  reason  text NOT NULL,
  inputs  jsonb NOT NULL DEFAULT '{}',
  outcome text NOT NULL,
  at      timestamptz NOT NULL DEFAULT now()
);

-- Wake-up hints; every worker also polls, because NOTIFY is not a delivery guarantee.
CREATE OR REPLACE FUNCTION custody.notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('custody_outbox', ''); RETURN NULL; END $$;
CREATE OR REPLACE FUNCTION custody.notify_successor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('custody_successor', ''); RETURN NULL; END $$;

DROP TRIGGER IF EXISTS outbox_notify ON custody.outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON custody.outbox
  FOR EACH STATEMENT EXECUTE FUNCTION custody.notify_outbox();
DROP TRIGGER IF EXISTS successor_notify ON custody.successor_intents;
CREATE TRIGGER successor_notify AFTER INSERT ON custody.successor_intents
  FOR EACH STATEMENT EXECUTE FUNCTION custody.notify_successor();

-- Added after the first release (idempotent for existing databases) ----------------
-- Why an instance is suspended when it is not an unknown outcome: 'definition_missing'
-- (its pinned process version is not loaded); the committer resumes it by itself once
-- the version is back.
ALTER TABLE custody.instances ADD COLUMN IF NOT EXISTS suspended_reason text;
-- A successor that could not be activated yet is tried again after this moment.
ALTER TABLE custody.successor_intents ADD COLUMN IF NOT EXISTS not_before timestamptz;
-- 'retired': a command that must never be sent (its operation is settled, cancelling or
-- at a later attempt); kept for the record, with a history row.
ALTER TABLE custody.outbox DROP CONSTRAINT IF EXISTS outbox_status_check;
ALTER TABLE custody.outbox ADD CONSTRAINT outbox_status_check
  CHECK (status IN ('pending', 'published', 'retired'));
-- Every (operation, attempt, owner revision) the receipt consumer has seen, with the
-- content it carried: a repeated revision with changed content is rejected.
CREATE INDEX IF NOT EXISTS receipt_inbox_revision
  ON custody.receipt_inbox (operation_id, attempt, owner_revision);
-- Data lifecycle: every periodic query (retention, archival) reaches its rows through an
-- index on the time column it filters, never by reading a table that grows with the
-- traffic (tests/integration/test_query_plans.py). Partial where only some rows age out.
CREATE INDEX IF NOT EXISTS instances_finished ON custody.instances (finished_at)
  WHERE status IN ('completed', 'failed', 'cancelled');
CREATE INDEX IF NOT EXISTS outbox_published ON custody.outbox (published_at)
  WHERE status = 'published';
CREATE INDEX IF NOT EXISTS outbox_retired ON custody.outbox (created_at)
  WHERE status = 'retired';
CREATE INDEX IF NOT EXISTS outbox_operation ON custody.outbox (operation_id);
CREATE INDEX IF NOT EXISTS receipt_inbox_received ON custody.receipt_inbox (received_at);
CREATE INDEX IF NOT EXISTS quarantine_received ON custody.quarantine (received_at);

-- Fencing: called last inside every engine commit. A worker paused past its lease
-- (a zombie) fails here, inside its own transaction, whatever its local clock says.
CREATE OR REPLACE FUNCTION custody.fence(p_holder text, p_epoch bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  PERFORM 1 FROM custody.leases
   WHERE holder = p_holder AND epoch = p_epoch AND expires_at > clock_timestamp();
  IF NOT FOUND THEN
    RAISE EXCEPTION 'lease % epoch % is not current', p_holder, p_epoch
      USING ERRCODE = 'CU001';
  END IF;
END $$;

-- The lifecycle guard --------------------------------------------------------------
-- The database refuses a status change the lifecycle does not allow, whoever attempts
-- it: a worker role, an operator role, the owner. The pairs are workers.core.lifecycle's
-- (status_changes() and INSTANCE_TRANSITIONS); tests/unit/test_lifecycle.py keeps them
-- equal. A repeat of the current status is not a change.
CREATE TABLE IF NOT EXISTS custody.operation_transitions (
  from_status custody.operation_status NOT NULL,
  to_status   custody.operation_status NOT NULL,
  PRIMARY KEY (from_status, to_status)
);
CREATE TABLE IF NOT EXISTS custody.instance_transitions (
  from_status custody.instance_status NOT NULL,
  to_status   custody.instance_status NOT NULL,
  PRIMARY KEY (from_status, to_status)
);
DELETE FROM custody.operation_transitions;
INSERT INTO custody.operation_transitions (from_status, to_status) VALUES
  ('accepted', 'cancelled'),
  ('accepted', 'cancelling'),
  ('accepted', 'failed'),
  ('accepted', 'outcome_unknown'),
  ('accepted', 'retry_waiting'),
  ('accepted', 'succeeded'),
  ('cancelling', 'cancelled'),
  ('cancelling', 'failed'),
  ('cancelling', 'succeeded'),
  ('dispatched', 'accepted'),
  ('dispatched', 'cancelled'),
  ('dispatched', 'cancelling'),
  ('dispatched', 'failed'),
  ('dispatched', 'outcome_unknown'),
  ('dispatched', 'retry_waiting'),
  ('dispatched', 'succeeded'),
  ('outcome_unknown', 'cancelled'),
  ('outcome_unknown', 'cancelling'),
  ('outcome_unknown', 'failed'),
  ('outcome_unknown', 'reconcile_pending'),
  ('outcome_unknown', 'retry_waiting'),
  ('outcome_unknown', 'succeeded'),
  ('pending', 'accepted'),
  ('pending', 'cancelled'),
  ('pending', 'cancelling'),
  ('pending', 'dispatched'),
  ('pending', 'failed'),
  ('pending', 'outcome_unknown'),
  ('pending', 'retry_waiting'),
  ('pending', 'succeeded'),
  ('reconcile_pending', 'cancelled'),
  ('reconcile_pending', 'cancelling'),
  ('reconcile_pending', 'failed'),
  ('reconcile_pending', 'outcome_unknown'),
  ('reconcile_pending', 'retry_waiting'),
  ('reconcile_pending', 'succeeded'),
  ('retry_waiting', 'cancelled'),
  ('retry_waiting', 'pending');
DELETE FROM custody.instance_transitions;
INSERT INTO custody.instance_transitions (from_status, to_status) VALUES
  ('cancelling', 'cancelled'),
  ('running', 'cancelling'),
  ('running', 'completed'),
  ('running', 'failed'),
  ('running', 'suspended'),
  ('suspended', 'cancelling'),
  ('suspended', 'running');

-- Besides: an outcome (accepted, succeeded, failed, retry_waiting) comes only from a
-- validated receipt, so only the receipt consumer's role may write one, and only the
-- publisher's the confirm mark. "Unknown effects cannot become success through an
-- operator assertion": not even by a hand-written UPDATE.
CREATE OR REPLACE FUNCTION custody.guard_operation_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status IS NOT DISTINCT FROM OLD.status THEN
    RETURN NEW;
  END IF;
  IF NOT EXISTS (
       SELECT 1 FROM custody.operation_transitions
        WHERE from_status = OLD.status AND to_status = NEW.status) THEN
    RAISE EXCEPTION 'illegal operation transition % -> % (operation %)',
      OLD.status, NEW.status, OLD.id USING ERRCODE = 'CU002';
  END IF;
  IF NEW.status IN ('accepted', 'succeeded', 'failed', 'retry_waiting')
     AND NOT pg_has_role(current_user, 'custody_receipts', 'MEMBER') THEN
    RAISE EXCEPTION 'only a validated receipt sets % (operation %, attempted by %)',
      NEW.status, OLD.id, current_user USING ERRCODE = 'CU003';
  END IF;
  IF NEW.status = 'dispatched' AND NOT pg_has_role(current_user, 'custody_publisher', 'MEMBER')
  THEN
    RAISE EXCEPTION 'only a broker confirm dispatches (operation %, attempted by %)',
      OLD.id, current_user USING ERRCODE = 'CU003';
  END IF;
  RETURN NEW;
END $$;
CREATE OR REPLACE FUNCTION custody.guard_instance_status() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status IS DISTINCT FROM OLD.status AND NOT EXISTS (
       SELECT 1 FROM custody.instance_transitions
        WHERE from_status = OLD.status AND to_status = NEW.status) THEN
    RAISE EXCEPTION 'illegal instance transition % -> % (instance %)',
      OLD.status, NEW.status, OLD.id USING ERRCODE = 'CU002';
  END IF;
  RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS operation_status_guard ON custody.operations;
CREATE TRIGGER operation_status_guard BEFORE UPDATE OF status ON custody.operations
  FOR EACH ROW EXECUTE FUNCTION custody.guard_operation_status();
DROP TRIGGER IF EXISTS instance_status_guard ON custody.instances;
CREATE TRIGGER instance_status_guard BEFORE UPDATE OF status ON custody.instances
  FOR EACH ROW EXECUTE FUNCTION custody.guard_instance_status();

-- The archive ----------------------------------------------------------------------
-- A finished instance leaves the hot tables once nothing can refer to it any more: it
-- moves, with its operations, node states, attempts, history and successor intents, to
-- the same tables in custody_archive, in one transaction per bounded batch (README,
-- "Retention"). Audit rows stay where they are. The archive tables have the hot tables'
-- columns in the same order (LIKE, placed after every ALTER ... ADD COLUMN above; a
-- column added to a hot table is added to its archive table in the same hunk, and
-- tests/integration/test_retention.py checks they agree), and no unique index: a start
-- replayed past every permitted horizon re-creates the same deterministic ids, and its
-- second archival must not fail.
CREATE SCHEMA IF NOT EXISTS custody_archive;
CREATE TABLE IF NOT EXISTS custody_archive.instances (LIKE custody.instances);
CREATE TABLE IF NOT EXISTS custody_archive.operations (LIKE custody.operations);
CREATE TABLE IF NOT EXISTS custody_archive.node_states (LIKE custody.node_states);
CREATE TABLE IF NOT EXISTS custody_archive.attempts (LIKE custody.attempts);
CREATE TABLE IF NOT EXISTS custody_archive.history (LIKE custody.history);
CREATE TABLE IF NOT EXISTS custody_archive.successor_intents (LIKE custody.successor_intents);
CREATE INDEX IF NOT EXISTS instances_id ON custody_archive.instances (id);
CREATE INDEX IF NOT EXISTS instances_start ON custody_archive.instances
  (tenant, start_request_id);
CREATE INDEX IF NOT EXISTS instances_finished ON custody_archive.instances (finished_at);
CREATE INDEX IF NOT EXISTS operations_id ON custody_archive.operations (id);
CREATE INDEX IF NOT EXISTS operations_instance ON custody_archive.operations (instance_id);
CREATE INDEX IF NOT EXISTS node_states_instance ON custody_archive.node_states (instance_id);
CREATE INDEX IF NOT EXISTS attempts_operation ON custody_archive.attempts (operation_id);
CREATE INDEX IF NOT EXISTS attempts_request ON custody_archive.attempts (request_id);
CREATE INDEX IF NOT EXISTS history_instance ON custody_archive.history (instance_id, id);
CREATE INDEX IF NOT EXISTS successor_intents_instance
  ON custody_archive.successor_intents (instance_id);

-- The move runs as custody_archiver (NOLOGIN: nobody logs in as it), the owner of the
-- one function below; the reconciler may only EXECUTE it, never delete a hot row itself.
-- An instance is due when it is finished (completed, failed, cancelled) for longer than
-- the horizon, every one of its operations is settled as long, and no row that is still
-- kept refers to it: no receipt-inbox row (kept CUSTODY_RETENTION_S after its receipt,
-- the receipts' deduplication), no outbox row (a sent command, kept as long), no pending
-- successor. The caller's horizon is checked at start-up to be at least the retention
-- horizon (workers/core/horizon.py), so every permitted retry, replay and restore is over.
-- A receipt that still comes later finds no operation and is quarantined
-- (unknown_operation), as any receipt of an unknown operation is.
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'custody_archiver') THEN
    CREATE ROLE custody_archiver NOLOGIN;
  END IF;
  -- the migrator must be able to hand the function to custody_archiver
  IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
     AND NOT pg_has_role(current_user, 'custody_archiver', 'MEMBER') THEN
    EXECUTE format('GRANT custody_archiver TO %I', current_user);
  END IF;
END $$;

CREATE OR REPLACE FUNCTION custody_archive.move_finished(p_after_s float8, p_limit integer)
RETURNS integer LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- (Each check is a scalar subquery per candidate, by key: a NOT EXISTS would let the
-- planner join the candidates against all of receipt_inbox or operations at once.)
WITH candidates AS (
  SELECT i.id, i.tenant, i.start_request_id FROM custody.instances i
   WHERE i.status IN ('completed', 'failed', 'cancelled')
     AND i.finished_at < now() - make_interval(secs => p_after_s)
     AND (SELECT 1 FROM custody.operations o
           WHERE o.instance_id = i.id
             AND (o.status NOT IN ('succeeded', 'failed', 'cancelled')
                  OR coalesce(o.finished_at, o.updated_at)
                     >= now() - make_interval(secs => p_after_s))
           LIMIT 1) IS NULL
     AND (SELECT 1 FROM custody.operations o
            JOIN custody.receipt_inbox r ON r.operation_id = o.id
           WHERE o.instance_id = i.id LIMIT 1) IS NULL
     AND (SELECT 1 FROM custody.operations o JOIN custody.outbox b ON b.operation_id = o.id
           WHERE o.instance_id = i.id LIMIT 1) IS NULL
     AND (SELECT 1 FROM custody.successor_intents s
           WHERE s.instance_id = i.id AND s.status = 'pending' LIMIT 1) IS NULL
   ORDER BY i.finished_at
   LIMIT p_limit
), due AS (
  -- under the lock a start of the same request takes (queries.sql start_locks): a start
  -- replayed while its instance moves waits, then finds it in the archive
  -- (instance_insert); one a start holds right now is left for the next pass
  SELECT c.id FROM candidates c
   WHERE pg_try_advisory_xact_lock(hashtext(c.tenant || '/' || c.start_request_id::text))
), ops AS (
  SELECT o.id FROM custody.operations o WHERE o.instance_id IN (SELECT id FROM due)
), a AS (
  DELETE FROM custody.attempts x WHERE x.operation_id IN (SELECT id FROM ops) RETURNING x.*
), a_in AS (
  INSERT INTO custody_archive.attempts SELECT * FROM a
), s AS (
  DELETE FROM custody.successor_intents x WHERE x.from_operation_id IN (SELECT id FROM ops)
  RETURNING x.*
), s_in AS (
  INSERT INTO custody_archive.successor_intents SELECT * FROM s
), h AS (
  DELETE FROM custody.history x WHERE x.instance_id IN (SELECT id FROM due) RETURNING x.*
), h_in AS (
  INSERT INTO custody_archive.history SELECT * FROM h
), n AS (
  DELETE FROM custody.node_states x WHERE x.instance_id IN (SELECT id FROM due) RETURNING x.*
), n_in AS (
  INSERT INTO custody_archive.node_states SELECT * FROM n
), o AS (
  DELETE FROM custody.operations x WHERE x.id IN (SELECT id FROM ops) RETURNING x.*
), o_in AS (
  INSERT INTO custody_archive.operations SELECT * FROM o
), i AS (
  DELETE FROM custody.instances x WHERE x.id IN (SELECT id FROM due) RETURNING x.*
), i_in AS (
  INSERT INTO custody_archive.instances SELECT * FROM i
)
SELECT count(*)::integer FROM i
$$;
ALTER FUNCTION custody_archive.move_finished(float8, integer) OWNER TO custody_archiver;
REVOKE ALL ON FUNCTION custody_archive.move_finished(float8, integer) FROM PUBLIC;

GRANT USAGE ON SCHEMA custody, custody_archive TO custody_archiver;
GRANT SELECT, DELETE ON custody.instances, custody.operations, custody.node_states,
  custody.attempts, custody.history, custody.successor_intents TO custody_archiver;
GRANT SELECT ON custody.receipt_inbox, custody.outbox TO custody_archiver;
GRANT INSERT ON ALL TABLES IN SCHEMA custody_archive TO custody_archiver;
-- Row-level security (the hot tables' is enabled in transitions.sql): the archiver reads
-- every row, and may delete only settled instances and operations, whatever its query
-- says. Operators read their tenants' archived rows (policies in transitions.sql).
DO $$
DECLARE t text;
BEGIN
  FOREACH t IN ARRAY ARRAY['instances', 'operations', 'node_states', 'attempts', 'history',
                           'successor_intents', 'receipt_inbox', 'outbox'] LOOP
    EXECUTE format('DROP POLICY IF EXISTS archiver_reads ON custody.%I', t);
    EXECUTE format('CREATE POLICY archiver_reads ON custody.%I FOR SELECT TO custody_archiver'
                   ' USING (true)', t);
  END LOOP;
  FOREACH t IN ARRAY ARRAY['instances', 'operations', 'node_states', 'attempts', 'history',
                           'successor_intents'] LOOP
    EXECUTE format('DROP POLICY IF EXISTS archiver_moves ON custody.%I', t);
    EXECUTE format('CREATE POLICY archiver_moves ON custody.%I FOR DELETE TO custody_archiver'
                   ' USING (%s)', t,
                   CASE t WHEN 'instances' THEN 'status IN (''completed'', ''failed'', ''cancelled'')'
                          WHEN 'operations' THEN 'status IN (''succeeded'', ''failed'', ''cancelled'')'
                          ELSE 'true' END);
    EXECUTE format('ALTER TABLE custody_archive.%I ENABLE ROW LEVEL SECURITY', t);
    EXECUTE format('DROP POLICY IF EXISTS archiver ON custody_archive.%I', t);
    EXECUTE format('CREATE POLICY archiver ON custody_archive.%I FOR INSERT TO custody_archiver'
                   ' WITH CHECK (true)', t);
  END LOOP;
END $$;

-- Least privilege ------------------------------------------------------------------
-- One role per worker type, granted only what its commit boundary needs (operators:
-- transitions.sql). Nobody but the owner may update or delete audit rows.
-- Passwords (or certificates) are the deployment's business; roles are LOGIN so that
-- a deployment can authenticate them however its pg_hba says.
DO $$
DECLARE r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['custody_committer', 'custody_publisher', 'custody_receipts',
                           'custody_reconciler'] LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('CREATE ROLE %I LOGIN', r);
    END IF;
  END LOOP;
END $$;

REVOKE ALL ON ALL TABLES IN SCHEMA custody FROM PUBLIC;
GRANT USAGE ON SCHEMA custody TO custody_committer, custody_publisher, custody_receipts,
  custody_reconciler;
GRANT SELECT, INSERT, UPDATE, DELETE ON custody.leases TO custody_committer, custody_publisher,
  custody_receipts, custody_reconciler;
GRANT EXECUTE ON FUNCTION custody.fence(text, bigint) TO custody_committer, custody_publisher,
  custody_receipts, custody_reconciler;
GRANT SELECT ON custody.control, custody.operation_transitions, custody.instance_transitions
  TO custody_committer, custody_publisher, custody_receipts, custody_reconciler;

-- Each worker role may update only the columns its commit boundary writes (a
-- table-level UPDATE from an earlier release is revoked first: revoking it also revokes
-- its column privileges).
REVOKE UPDATE ON custody.instances, custody.node_states, custody.operations,
  custody.start_tombstones, custody.successor_intents, custody.outbox
  FROM custody_committer, custody_publisher, custody_receipts, custody_reconciler;

-- transition committer: starts and successors (an authorized cancel request goes through
-- custody.t_cancel_start, transitions.sql)
GRANT SELECT, INSERT ON custody.instances, custody.node_states, custody.operations,
  custody.start_tombstones TO custody_committer;
GRANT UPDATE (status, suspended_reason, updated_at, finished_at) ON custody.instances
  TO custody_committer;
GRANT UPDATE (status, updated_at) ON custody.node_states TO custody_committer;
GRANT UPDATE (late_start_at) ON custody.start_tombstones TO custody_committer;
GRANT SELECT, INSERT ON custody.attempts TO custody_committer;
GRANT INSERT ON custody.outbox, custody.history, custody.quarantine, custody.audit
  TO custody_committer;
REVOKE SELECT ON custody.outbox FROM custody_committer;  -- earlier releases
GRANT SELECT ON custody.successor_intents TO custody_committer;
-- a start request is deduplicated against archived instances too (instance_insert): the
-- committer reads the archive's instance keys, every tenant's.
GRANT USAGE ON SCHEMA custody_archive TO custody_committer;
GRANT SELECT (tenant, start_request_id) ON custody_archive.instances TO custody_committer;
ALTER TABLE custody_archive.instances ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS committer_dedupes ON custody_archive.instances;
CREATE POLICY committer_dedupes ON custody_archive.instances FOR SELECT TO custody_committer
  USING (true);
GRANT UPDATE (status, done_at, not_before) ON custody.successor_intents TO custody_committer;

-- outbox publisher: claims and marks; the confirm mark moves pending → dispatched
GRANT SELECT ON custody.outbox TO custody_publisher;
GRANT UPDATE (status, claimed_by, claim_expires_at, publish_attempts, next_attempt_at,
              last_error, published_at) ON custody.outbox TO custody_publisher;
GRANT SELECT ON custody.instances, custody.attempts TO custody_publisher;
GRANT SELECT ON custody.operations TO custody_publisher;
GRANT UPDATE (status, updated_at, deadline_at) ON custody.operations TO custody_publisher;
GRANT INSERT ON custody.history TO custody_publisher;
GRANT SELECT ON custody.outbox_pending_rows TO custody_publisher;  -- outbox_stats

-- receipt consumer: validated result, status, revision, successor intent, quarantine
GRANT SELECT ON custody.operations, custody.instances, custody.node_states
  TO custody_receipts;
GRANT UPDATE (status, effect, owner_revision, receipt_hash, result, error, updated_at,
              deadline_at, retry_at, finished_at) ON custody.operations TO custody_receipts;
GRANT UPDATE (status, suspended_reason, updated_at, finished_at) ON custody.instances
  TO custody_receipts;
GRANT UPDATE (status, updated_at) ON custody.node_states TO custody_receipts;
GRANT SELECT ON custody.attempts TO custody_receipts;
GRANT SELECT, INSERT ON custody.receipt_inbox TO custody_receipts;
GRANT SELECT, INSERT ON custody.successor_intents TO custody_receipts;
GRANT INSERT ON custody.quarantine, custody.history TO custody_receipts;

-- reconciler: deadlines, query timeouts, retention (its retry and reconcile policies go
-- through custody.t_retry_safe and custody.t_reconcile, transitions.sql)
GRANT SELECT ON custody.operations, custody.instances, custody.node_states
  TO custody_reconciler;
-- statuses only (operation_set_status, instance_suspend): never an outcome's evidence
-- (effect, result, revision) nor what an operation is or where it goes
GRANT UPDATE (status, updated_at) ON custody.operations, custody.instances
  TO custody_reconciler;
REVOKE INSERT ON custody.attempts, custody.outbox FROM custody_reconciler;  -- earlier releases
GRANT SELECT ON custody.attempts TO custody_reconciler;
GRANT SELECT, DELETE ON custody.outbox TO custody_reconciler;  -- retention
GRANT SELECT ON custody.outbox_pending_rows TO custody_reconciler;  -- dispatch_stats
GRANT SELECT, DELETE ON custody.receipt_inbox, custody.quarantine TO custody_reconciler;
GRANT SELECT ON custody.successor_intents TO custody_reconciler;
GRANT INSERT ON custody.history TO custody_reconciler;
-- archival: only through the archiver's function (no DELETE on a hot table of its own)
GRANT USAGE ON SCHEMA custody_archive TO custody_reconciler;
GRANT EXECUTE ON FUNCTION custody_archive.move_finished(float8, integer) TO custody_reconciler;

-- operators: their own login roles, members of custody_operators; they read (row-level
-- security) and run the controlled commands of transitions.sql, and write nothing.

GRANT USAGE ON ALL SEQUENCES IN SCHEMA custody TO custody_committer, custody_publisher,
  custody_receipts, custody_reconciler;
