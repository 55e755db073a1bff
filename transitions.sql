-- custody: the controlled recovery commands, in the database (applied after schema.sql
-- and commands.sql; idempotent), and the statements on every receipt's way planned once,
-- by their keys (below claimed_instances).
--
-- "Operators use controlled recovery commands rather than editing runtime rows
-- directly." An operator is a Postgres login role of its own, registered in
-- custody.operators (synced from deploy/operators.toml by `custody db migrate` or
-- `custody operators apply`) and a member of custody_operators. That group may read
-- (row-level security limits it to its tenants) and may EXECUTE the operator
-- functions below; it may not write a single row. Each function is SECURITY DEFINER,
-- owned by custody_definer (NOLOGIN: nobody logs in as it), and:
--   * takes the actor from session_user, the authenticated login, never an argument;
--   * checks the operator's authorization for the action and the target's tenant;
--   * checks the lifecycle (custody.operation_events, generated from
--     workers/core/lifecycle.py and checked against it by a test), and the status guard
--     trigger checks it again for every role;
--   * writes the history and the audit row (done or refused) in the same transaction
--     as the effect.
-- The workers' automatic policies (retry policy, reconcile policy, a broker-validated
-- cancel request, retiring undeliverable submits) call the same t_* functions with
-- their own actor; only the worker roles named below may.

-- Roles -------------------------------------------------------------------------------
DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'custody_operators') THEN
    CREATE ROLE custody_operators NOLOGIN;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'custody_definer') THEN
    CREATE ROLE custody_definer NOLOGIN;
  END IF;
  -- the migrator must be able to hand the functions to custody_definer
  IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
     AND NOT pg_has_role(current_user, 'custody_definer', 'MEMBER') THEN
    EXECUTE format('GRANT custody_definer TO %I', current_user);
  END IF;
END $$;

-- Who may do what, per tenant ("*" = every tenant) ---------------------------------------
CREATE TABLE IF NOT EXISTS custody.operators (
  name       text PRIMARY KEY,
  actions    text[] NOT NULL DEFAULT '{}',
  tenants    text[] NOT NULL DEFAULT '{}',
  updated_at timestamptz NOT NULL DEFAULT now()
);

-- The operation lifecycle by event, as workers/core/lifecycle.py's TRANSITIONS (the events
-- the functions below use; a test checks the rows against the Python table).
CREATE TABLE IF NOT EXISTS custody.operation_events (
  from_status custody.operation_status NOT NULL,
  event       text NOT NULL,
  to_status   custody.operation_status NOT NULL,
  PRIMARY KEY (from_status, event)
);
DELETE FROM custody.operation_events;
INSERT INTO custody.operation_events (from_status, event, to_status) VALUES
  ('accepted', 'cancel', 'cancelling'),
  ('dispatched', 'cancel', 'cancelling'),
  ('outcome_unknown', 'cancel', 'cancelling'),
  ('pending', 'cancel', 'cancelling'),
  ('reconcile_pending', 'cancel', 'cancelling'),
  ('retry_waiting', 'cancel', 'cancelled'),
  ('outcome_unknown', 'reconcile', 'reconcile_pending'),
  ('accepted', 'restored', 'outcome_unknown'),
  ('dispatched', 'restored', 'outcome_unknown'),
  ('retry_waiting', 'retry_safe', 'pending');

-- Helpers (not callable by operators: every helper below is revoked from PUBLIC) ---------
CREATE OR REPLACE FUNCTION custody.canonical_id(p_value text) RETURNS uuid
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  RETURN regexp_replace(btrim(p_value), '^urn:uuid:', '', 'i')::uuid;
EXCEPTION WHEN invalid_text_representation OR null_value_not_allowed THEN
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION custody.next_status(p_from custody.operation_status, p_event text)
RETURNS custody.operation_status LANGUAGE sql STABLE AS $$
  SELECT to_status FROM custody.operation_events WHERE from_status = p_from AND event = p_event
$$;

CREATE OR REPLACE FUNCTION custody.operator_actor() RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
  -- session_user is the authenticated login; SET ROLE cannot change it
  IF session_user::text = 'policy' THEN
    RAISE EXCEPTION 'a login named policy cannot act as an operator' USING ERRCODE = '42501';
  END IF;
  RETURN session_user::text;
END $$;

-- Why ``actor`` may not do ``action`` on ``tenant`` (NULL: every tenant), or NULL.
CREATE OR REPLACE FUNCTION custody.refusal(
  p_actor text, p_action text, p_tenant text, p_reason text
) RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
  v custody.operators;
BEGIN
  IF p_actor = 'policy' THEN
    RETURN NULL;
  END IF;
  IF length(regexp_replace(coalesce(p_reason, ''), '^\s+|\s+$', '', 'g')) < 8 THEN
    RETURN 'a reason of at least 8 characters is required';
  END IF;
  SELECT * INTO v FROM custody.operators WHERE name = p_actor;
  IF NOT FOUND THEN
    RETURN format('''%s'' is not an operator', p_actor);
  END IF;
  IF NOT p_action = ANY (v.actions) THEN
    RETURN format('''%s'' may not %s', p_actor, p_action);
  END IF;
  IF '*' = ANY (v.tenants) THEN
    RETURN NULL;
  END IF;
  IF p_tenant IS NULL THEN
    RETURN format('''%s'' may not %s for every tenant', p_actor, p_action);
  END IF;
  IF NOT p_tenant = ANY (v.tenants) THEN
    RETURN format('''%s'' may not %s for tenant ''%s''', p_actor, p_action, p_tenant);
  END IF;
  RETURN NULL;
END $$;

-- The tenants the current login may see (row-level security), evaluated once per query.
CREATE OR REPLACE FUNCTION custody.visible_tenants() RETURNS text[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT coalesce((SELECT tenants FROM custody.operators WHERE name = session_user::text), '{}')
$$;

CREATE OR REPLACE FUNCTION custody.history_add(
  p_instance uuid, p_operation uuid, p_event text, p_actor text, p_detail jsonb
) RETURNS void LANGUAGE sql AS $$
  INSERT INTO custody.history (instance_id, operation_id, event, detail, actor)
  VALUES (p_instance, p_operation, p_event, p_detail, p_actor)
$$;

-- The command's result, with its audit row (every operator command, done or refused).
CREATE OR REPLACE FUNCTION custody.outcome(
  p_actor text, p_action text, p_tenant text, p_target text, p_reason text, p_inputs jsonb,
  p_result text, p_message text, p_data jsonb DEFAULT '{}'
) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  IF p_actor <> 'policy' THEN
    INSERT INTO custody.audit (actor, action, tenant, target, reason, inputs, outcome)
    VALUES (p_actor, p_action, p_tenant, p_target, p_reason,
            CASE WHEN p_result = 'done' THEN p_inputs
                 ELSE p_inputs || jsonb_build_object('refusal', p_message) END,
            p_result);
  END IF;
  RETURN jsonb_build_object('result', p_result, 'message', p_message, 'data', p_data);
END $$;

CREATE OR REPLACE FUNCTION custody.next_sequence(p_operation uuid, p_attempt int, p_kind text)
RETURNS int LANGUAGE sql STABLE AS $$
  SELECT count(*)::int + 1 FROM custody.attempts
   WHERE operation_id = p_operation AND attempt = p_attempt AND kind = p_kind
$$;

-- The instances the committer's successor_claim (queries.sql) locked in this
-- transaction: the reads that depend on the claim take their ids from here, so that they
-- leave in the claim's round trip (empty before any claim, and after one that found none).
CREATE OR REPLACE FUNCTION custody.claimed_instances() RETURNS uuid[]
LANGUAGE sql STABLE AS $$
  SELECT string_to_array(coalesce(current_setting('custody.claimed_instances', true), ''),
                         ',')::uuid[]
$$;

CREATE OR REPLACE FUNCTION custody.changed_under_lock(p_what text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION '% changed under its row lock', p_what USING ERRCODE = 'CU004';
END $$;

-- Reads planned once, by their keys ------------------------------------------------------
-- The receipt consumer's reads (queries.sql calls each by the same name), planned once per
-- session and kept: a PL/pgSQL function keeps the plan of its statement, and their
-- settings (given to them at once, after the writes below), in force while one runs and
-- only then, make it a generic plan that reaches every table by its keys, whatever the
-- table's size or statistics when it is made (a plan that a worker prepared while the
-- tables were young and kept as they grew read them in full: test_query_plans.py). As
-- plain statements they were planned for each execution instead, so as to see the tables
-- as they are: a tenth of a millisecond and more of the backend's time per statement, on
-- every receipt's way at light load. The writes follow (Writes planned once, one row at
-- a time).
-- A release's workers call these by name and signature, and the previous release's
-- workers still run while its migrate re-applies this file: a change of a function's
-- arguments or columns is a new function under a new name (operations_lock_v2), the old
-- one dropped in a later release (expand, then contract, as for migrations); a change of
-- a body takes effect for both releases at once.

-- The batch's operations, locked in key order, with what a receipt is judged by (not the
-- operation's input or lineage document: only its pinned process version).
CREATE OR REPLACE FUNCTION custody.operations_lock(p_ids uuid[])
RETURNS TABLE (id uuid, tenant text, instance_id uuid, node text, owner text,
               principal text, attempt integer, status custody.operation_status,
               effect custody.effect, owner_revision integer, receipt_hash text,
               process text, process_version integer, created_at timestamptz,
               instance_status text)
LANGUAGE plpgsql
AS $$
BEGIN
  RETURN QUERY
  SELECT o.id, o.tenant, o.instance_id, o.node, o.owner, o.principal, o.attempt, o.status,
         o.effect, o.owner_revision, o.receipt_hash, o.lineage->>'process',
         (o.lineage->>'process_version')::integer, o.created_at, i.status::text
    FROM custody.operations o JOIN custody.instances i ON i.id = o.instance_id
   WHERE o.id = ANY(p_ids)
   ORDER BY o.id
     FOR UPDATE OF o;
END $$;

-- Every (operation, attempt, owner revision) already recorded, with its content.
CREATE OR REPLACE FUNCTION custody.revisions_seen(
  p_operation uuid[], p_attempt integer[], p_revision integer[])
RETURNS TABLE (operation_id text, attempt integer, owner_revision integer, content_hash text)
LANGUAGE plpgsql
AS $$
BEGIN
  RETURN QUERY
  SELECT r.operation_id::text, r.attempt, r.owner_revision, r.content_hash
    FROM custody.receipt_inbox r
   WHERE (r.operation_id, r.attempt, r.owner_revision) IN (
         SELECT * FROM unnest(p_operation, p_attempt, p_revision));
END $$;

-- The instances of a batch's terminal receipts, locked only where no one holds them (the
-- committer's claim, a cancel, an operator's command: their intents are left to the
-- committer), after the batch's operations (operations_lock, sent before: the receipt
-- consumer never waits for an instance while it holds operations). A cancel that commits
-- first is seen here; one that comes later waits for this commit and sees the new
-- operation. Their ids are kept in the transaction (custody.claimed_instances) for
-- instance_results and node_activations, sent after it, as in successor_claim.
CREATE OR REPLACE FUNCTION custody.receipt_instances_claim(p_ids uuid[])
RETURNS TABLE (instance_id uuid, tenant text, instance_status text, process text,
               process_version integer, input jsonb, traceparent text, routes jsonb)
LANGUAGE plpgsql
AS $$
BEGIN
  RETURN QUERY
  WITH c AS (
    SELECT i.id AS instance_id, i.tenant, i.status::text AS instance_status, i.process,
           i.process_version, i.input, i.traceparent, i.routes
      FROM custody.instances i
     WHERE i.id IN (SELECT o.instance_id FROM custody.operations o
                     WHERE o.id = ANY(p_ids)
                       -- a duplicate or late receipt of a settled operation moves nothing
                       -- on: its instance is not held (this transaction locked these rows).
                       -- The status as text: by the operations' keys, never every open
                       -- operation through operations_open, whose predicate the enum's
                       -- own NOT IN proves (the bench's backlog, 20,000 open: the generic
                       -- plan read them all for each batch, 110 ms)
                       AND o.status::text NOT IN ('succeeded', 'failed', 'cancelled'))
     ORDER BY i.id
       FOR UPDATE OF i SKIP LOCKED
  ), kept AS (
    SELECT set_config('custody.claimed_instances',
                      coalesce(string_agg(c.instance_id::text, ','), ''), true)
      FROM c
  )
  SELECT c.* FROM c CROSS JOIN kept ORDER BY c.instance_id;
END $$;

-- The results of the instances claimed in this transaction (successor_claim's or
-- receipt_instances_claim's), their successors are planned from.
CREATE OR REPLACE FUNCTION custody.instance_results()
RETURNS TABLE (instance_id uuid, node text, result jsonb)
LANGUAGE plpgsql
AS $$
BEGIN
  RETURN QUERY
  SELECT o.instance_id, o.node, o.result FROM custody.operations o
   WHERE o.instance_id = ANY((SELECT custody.claimed_instances())::uuid[])
     AND o.status = 'succeeded'
   ORDER BY o.instance_id, o.node, o.activation;
END $$;

-- Writes planned once, one row at a time --------------------------------------------------
-- The batch writes on a receipt's way (queries.sql calls receipt_writes, which calls
-- operation_apply and node_finish), the ends of instances and the engine's confirm mark
-- (queries.sql calls each by the same name): each row of the batch is written by its own
-- execution of a statement that names its key (a primary key, or node_states_operation),
-- planned once per session with the settings below. A statement joined to the whole batch
-- (a jsonb set) would have to be planned for each execution instead: its generic plan,
-- made on young tables, read the table whole (an index with no key, a nested loop over the
-- batch's 200 rows; 76 and 176 ms a statement in a burst). Planned for each execution, it
-- cost every light-load receipt a tenth to half a millisecond on its way; a loop costs a
-- burst's batch of 200 about a millisecond more than it (test_query_plans.py;
-- docs/performance.md).

-- A batch's operation changes (each operation at most once: records.fold_updates), each
-- guarded by the status it was judged from: a change whose row is no longer in that status
-- (changed under its lock) fails the whole call (CU004, the unit is redone), so that the
-- caller need not wait for a row count.
CREATE OR REPLACE FUNCTION custody.operation_apply(p_rows jsonb) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
  r record;
  v_changed integer;
BEGIN
  FOR r IN SELECT * FROM jsonb_to_recordset(p_rows)
           AS x(id uuid, expected custody.operation_status, status custody.operation_status,
                effect custody.effect, owner_revision integer, receipt_hash text,
                result jsonb, error jsonb, terminal boolean, retry_in double precision) LOOP
    UPDATE custody.operations o
       SET status = r.status, effect = r.effect, owner_revision = r.owner_revision,
           receipt_hash = r.receipt_hash, result = coalesce(r.result, o.result),
           error = coalesce(r.error, o.error), updated_at = now(),
           deadline_at = coalesce(o.deadline_at,
                                  now() + make_interval(secs => o.deadline_seconds)),
           retry_at = now() + make_interval(secs => r.retry_in),
           finished_at = CASE WHEN r.terminal THEN now() END
     WHERE o.id = r.id AND o.status::text = r.expected::text;
    GET DIAGNOSTICS v_changed = ROW_COUNT;
    IF v_changed <> 1 THEN
      PERFORM custody.changed_under_lock('an operation of the batch');
    END IF;
  END LOOP;
END $$;

-- A batch's finished nodes (an operation's node, while it is active).
CREATE OR REPLACE FUNCTION custody.node_finish(p_rows jsonb) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE r record;
BEGIN
  FOR r IN SELECT * FROM jsonb_to_recordset(p_rows) AS x(operation_id uuid, status text) LOOP
    UPDATE custody.node_states n SET status = r.status, updated_at = now()
     WHERE n.operation_id = r.operation_id AND n.status = 'active';
  END LOOP;
END $$;

-- A receipt batch's writes in one call, in the order each depends on: the receipts'
-- identities (each applies at most once), the operations' changes (operation_apply: a row
-- changed under its lock fails the call, CU004), their finished nodes (node_finish), and
-- the successor intents (one the receipt consumer activated in this transaction written
-- done: only pending ones wake the committer). One statement on the unit's way where
-- these were four (about 65 µs of the worker's client path each).
CREATE OR REPLACE FUNCTION custody.receipt_writes(
  p_receipts jsonb, p_updates jsonb, p_nodes jsonb, p_successors jsonb) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
  INSERT INTO custody.receipt_inbox (receipt_id, operation_id, attempt, owner_revision, status,
                                     content_hash, decision)
  SELECT r.receipt_id, r.operation_id, r.attempt, r.owner_revision, r.status, r.content_hash,
         r.decision
    FROM jsonb_to_recordset(p_receipts)
         AS r(receipt_id uuid, operation_id uuid, attempt integer, owner_revision integer,
              status text, content_hash text, decision text)
  ON CONFLICT (receipt_id) DO NOTHING;
  PERFORM custody.operation_apply(p_updates);
  PERFORM custody.node_finish(p_nodes);
  INSERT INTO custody.successor_intents (instance_id, from_operation_id, outcome, next_node,
                                         status, done_at)
  SELECT r.instance_id, r.from_operation_id, r.outcome, r.next_node,
         CASE WHEN r.done THEN 'done' ELSE 'pending' END,
         CASE WHEN r.done THEN now() END
    FROM ROWS FROM (jsonb_to_recordset(p_successors)
                    AS (instance_id uuid, from_operation_id uuid, outcome text,
                        next_node text, done boolean))
         WITH ORDINALITY AS r(instance_id, from_operation_id, outcome, next_node, done, n)
   ORDER BY r.n
  ON CONFLICT (from_operation_id) DO NOTHING;
END $$;

-- A batch's ends, each only from running, in the batch's order; returns the instances
-- ended. An end given its history row writes it here, only if it did end the instance: a
-- unit that writes nothing after its ends need not wait for which ones they were. The
-- status as text: the instance by its key, never every running one through
-- instances_status (see instance_suspend_for in queries.sql).
CREATE OR REPLACE FUNCTION custody.instance_finish(p_rows jsonb) RETURNS TABLE (id uuid)
LANGUAGE plpgsql
AS $$
DECLARE r record;
BEGIN
  FOR r IN SELECT * FROM jsonb_to_recordset(p_rows)
           AS x(id uuid, status custody.instance_status, history jsonb) LOOP
    UPDATE custody.instances i SET status = r.status, finished_at = now(), updated_at = now()
     WHERE i.id = r.id AND i.status::text = 'running';
    CONTINUE WHEN NOT FOUND;
    IF r.history IS NOT NULL THEN
      INSERT INTO custody.history (instance_id, operation_id, event, detail, actor)
      VALUES (r.id, (r.history->>'operation_id')::uuid, r.history->>'event',
              coalesce(r.history->'detail', '{}'), r.history->>'actor');
    END IF;
    id := r.id;
    RETURN NEXT;
  END LOOP;
END $$;

-- The engine's confirm mark: the confirmed rows that this publisher's claim holds are
-- marked published, and each confirmed submit among them dispatches its operation, in the
-- operations' key order, with one history row per operation it moved. The confirm mark
-- never moves an operation backward; the deadline clock starts here. Only a submit's
-- confirm dispatches (a query's or a cancel's confirm is not progress), and only the submit
-- of the operation's current attempt: a late confirm of attempt n's submit does not
-- dispatch attempt n+1, whose own submit may not have been sent. Returns how many rows it
-- marked.
CREATE OR REPLACE FUNCTION custody.outbox_mark_dispatched(
  p_ids uuid[], p_holder text, p_actor text) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
  r record;
  v_marked integer := 0;
  v_instance uuid;
BEGIN
  FOR r IN SELECT b.id, b.kind, b.operation_id FROM custody.outbox b
            WHERE b.id = ANY(p_ids) ORDER BY b.operation_id, b.id LOOP
    -- lower(): the row by its key, never every pending one through outbox_pending, whose
    -- predicate (status = 'pending') a plain comparison would prove
    UPDATE custody.outbox b
       SET status = 'published', published_at = now(), claimed_by = NULL,
           claim_expires_at = NULL, last_error = NULL
     WHERE b.id = r.id AND b.claimed_by = p_holder AND lower(b.status) = 'pending';
    CONTINUE WHEN NOT FOUND;
    v_marked := v_marked + 1;
    CONTINUE WHEN r.kind <> 'submit';
    UPDATE custody.operations o
       SET status = 'dispatched', updated_at = now(),
           deadline_at = coalesce(o.deadline_at,
                                  now() + make_interval(secs => o.deadline_seconds))
     WHERE o.id = r.operation_id AND o.status::text = 'pending'
       AND EXISTS (SELECT 1 FROM custody.attempts a
                    WHERE a.request_id = r.id AND a.kind = 'submit'
                      AND a.operation_id = o.id AND a.attempt = o.attempt)
    RETURNING o.instance_id INTO v_instance;
    CONTINUE WHEN NOT FOUND;
    INSERT INTO custody.history (instance_id, operation_id, event, detail, actor)
    VALUES (v_instance, r.operation_id, 'operation.dispatched', '{}', p_actor);
  END LOOP;
  RETURN v_marked;
END $$;

-- The settings of the reads and the writes planned once, in one place (CREATE OR REPLACE
-- above clears a function's own): generic plans, reaching every table by its keys.
DO $$
DECLARE f regprocedure;
BEGIN
  FOREACH f IN ARRAY ARRAY['custody.operations_lock(uuid[])',
                           'custody.revisions_seen(uuid[], integer[], integer[])',
                           'custody.receipt_instances_claim(uuid[])',
                           'custody.instance_results()',
                           'custody.operation_apply(jsonb)', 'custody.node_finish(jsonb)',
                           'custody.receipt_writes(jsonb, jsonb, jsonb, jsonb)',
                           'custody.instance_finish(jsonb)',
                           'custody.outbox_mark_dispatched(uuid[], text, text)']::regprocedure[] LOOP
    EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan'
                   ' SET enable_seqscan = off SET enable_hashjoin = off'
                   ' SET enable_mergejoin = off SET jit = off', f);
  END LOOP;
END $$;

-- Retire the pending submits that must never be sent (of one operation, or all): the
-- operation is settled or cancelling, or the submit is for an earlier attempt.
CREATE OR REPLACE FUNCTION custody.t_retire_submits(p_actor text, p_operation uuid DEFAULT NULL)
RETURNS int LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  n int;
BEGIN
  WITH retired AS (
    UPDATE custody.outbox b
       SET status = 'retired', claimed_by = NULL, claim_expires_at = NULL,
           last_error = 'retired: operation ' || op.status::text
      FROM custody.operations op
     WHERE b.status = 'pending' AND b.kind = 'submit' AND op.id = b.operation_id
       AND (p_operation IS NULL OR b.operation_id = p_operation)
       AND (b.claim_expires_at IS NULL OR b.claim_expires_at < clock_timestamp())
       AND (op.status IN ('succeeded', 'failed', 'cancelled', 'cancelling')
            OR b.id <> (SELECT a.request_id FROM custody.attempts a
                         WHERE a.operation_id = op.id AND a.attempt = op.attempt
                           AND a.kind = 'submit'))
    RETURNING b.id, op.id AS operation_id, op.instance_id, op.status
  ), written AS (
    INSERT INTO custody.history (instance_id, operation_id, event, detail, actor)
    SELECT instance_id, operation_id, 'command.retired',
           jsonb_build_object('request_id', id::text, 'operation_status', status::text), p_actor
      FROM retired
    RETURNING 1
  )
  SELECT count(*) INTO n FROM written;
  RETURN n;
END $$;

-- Attempt n+1 of the same operation and input: a new command identity.
CREATE OR REPLACE FUNCTION custody.new_attempt(
  p_actor text, p_op custody.operations, p_reason text
) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
  v_attempt int := p_op.attempt + 1;
  v_to custody.operation_status := custody.next_status(p_op.status, 'retry_safe');
  v_request uuid;
BEGIN
  UPDATE custody.operations
     SET attempt = v_attempt, digest = custody.attempt_digest(p_op.id, v_attempt),
         status = v_to, effect = 'unknown', owner_revision = 0, receipt_hash = NULL,
         result = NULL, error = NULL, deadline_at = NULL, retry_at = NULL, updated_at = now()
   WHERE id = p_op.id AND status = 'retry_waiting' AND effect = 'none'
     AND attempt = p_op.attempt;
  IF NOT FOUND THEN
    PERFORM custody.changed_under_lock('operation ' || p_op.id);
  END IF;
  v_request := custody.issue_command(p_op.id, 'submit', 1, NULL);
  PERFORM custody.history_add(p_op.instance_id, p_op.id, 'operation.pending', p_actor,
    jsonb_build_object('from', 'retry_waiting', 'attempt', v_attempt,
                       'request_id', v_request::text, 'reason', p_reason));
  RETURN v_request;
END $$;

-- Record ReconcilePending and a query intent against the pinned executor.
CREATE OR REPLACE FUNCTION custody.t_reconcile(p_actor text, p_operation text, p_reason text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_inputs jsonb := jsonb_build_object('operation_id', p_operation);
  v_op custody.operations;
  v_why text;
  v_to custody.operation_status;
  v_request uuid;
BEGIN
  SELECT * INTO v_op FROM custody.operations
   WHERE id = custody.canonical_id(p_operation) FOR UPDATE;
  IF NOT FOUND THEN
    RETURN custody.outcome(p_actor, 'reconcile', NULL, p_operation, p_reason, v_inputs,
                           'not_found', format('no operation %s', p_operation));
  END IF;
  v_why := custody.refusal(p_actor, 'reconcile', v_op.tenant, p_reason);
  IF v_why IS NULL THEN
    v_to := custody.next_status(v_op.status, 'reconcile');
    IF v_to IS NULL THEN
      v_why := format('reconcile needs outcome_unknown; operation %s is %s',
                      p_operation, v_op.status);
    END IF;
  END IF;
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'reconcile', v_op.tenant, p_operation, p_reason,
                           v_inputs, 'refused', v_why);
  END IF;
  UPDATE custody.operations
     SET status = v_to, updated_at = now(),
         deadline_at = now() + make_interval(secs => deadline_seconds)
   WHERE id = v_op.id AND status = v_op.status;
  IF NOT FOUND THEN
    PERFORM custody.changed_under_lock('operation ' || v_op.id);
  END IF;
  v_request := custody.issue_command(
    v_op.id, 'query', custody.next_sequence(v_op.id, v_op.attempt, 'query'), NULL);
  PERFORM custody.history_add(v_op.instance_id, v_op.id, 'operation.' || v_to, p_actor,
    jsonb_build_object('from', v_op.status::text, 'query_request_id', v_request::text,
                       'reason', p_reason));
  RETURN custody.outcome(p_actor, 'reconcile', v_op.tenant, p_operation, p_reason, v_inputs,
    'done',
    format('operation %s is reconcile_pending; query %s sent to %s on %s',
           p_operation, v_request, v_op.owner, v_op.binding),
    jsonb_build_object('operation_id', p_operation, 'status', 'reconcile_pending',
                       'query_request_id', v_request::text));
END $$;

-- A new attempt, only from authoritative RetryWaiting with effect none.
CREATE OR REPLACE FUNCTION custody.t_retry_safe(p_actor text, p_operation text, p_reason text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_inputs jsonb := jsonb_build_object('operation_id', p_operation);
  v_op custody.operations;
  v_why text;
  v_request uuid;
BEGIN
  SELECT * INTO v_op FROM custody.operations
   WHERE id = custody.canonical_id(p_operation) FOR UPDATE;
  IF NOT FOUND THEN
    RETURN custody.outcome(p_actor, 'retry-safe', NULL, p_operation, p_reason, v_inputs,
                           'not_found', format('no operation %s', p_operation));
  END IF;
  v_why := custody.refusal(p_actor, 'retry-safe', v_op.tenant, p_reason);
  IF v_why IS NULL AND NOT (v_op.status = 'retry_waiting' AND v_op.effect = 'none') THEN
    v_why := format('retry-safe needs retry_waiting with effect none established by a '
                    'validated receipt; operation %s is %s with effect %s',
                    p_operation, v_op.status, v_op.effect);
  END IF;
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'retry-safe', v_op.tenant, p_operation, p_reason,
                           v_inputs, 'refused', v_why);
  END IF;
  v_request := custody.new_attempt(p_actor, v_op, p_reason);
  RETURN custody.outcome(p_actor, 'retry-safe', v_op.tenant, p_operation, p_reason, v_inputs,
    'done',
    format('operation %s attempt %s dispatched as %s', p_operation, v_op.attempt + 1, v_request),
    jsonb_build_object('operation_id', p_operation, 'attempt', v_op.attempt + 1,
                       'request_id', v_request::text));
END $$;

-- Hold or release effect dispatch, globally (NULL instance) or for one instance.
CREATE OR REPLACE FUNCTION custody.t_set_paused(
  p_actor text, p_paused boolean, p_reason text, p_instance text DEFAULT NULL
) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_action text := CASE WHEN p_paused THEN 'pause' ELSE 'resume' END;
  v_word text := CASE WHEN p_paused THEN 'paused' ELSE 'resumed' END;
  v_inputs jsonb := jsonb_build_object('instance_id', p_instance);
  v_target text := coalesce(p_instance, '*');
  v_inst custody.instances;
  v_why text;
BEGIN
  IF p_instance IS NULL THEN
    v_why := custody.refusal(p_actor, v_action, NULL, p_reason);
    IF v_why IS NOT NULL THEN
      RETURN custody.outcome(p_actor, v_action, NULL, v_target, p_reason, v_inputs,
                             'refused', v_why);
    END IF;
    UPDATE custody.control SET dispatch_paused = p_paused, updated_at = now();
    RETURN custody.outcome(p_actor, v_action, NULL, v_target, p_reason, v_inputs, 'done',
      format('effect dispatch %s globally', v_word),
      jsonb_build_object('dispatch_paused', p_paused));
  END IF;
  SELECT * INTO v_inst FROM custody.instances WHERE id = custody.canonical_id(p_instance);
  IF NOT FOUND THEN
    RETURN custody.outcome(p_actor, v_action, NULL, v_target, p_reason, v_inputs,
                           'not_found', format('no instance %s', p_instance));
  END IF;
  v_why := custody.refusal(p_actor, v_action, v_inst.tenant, p_reason);
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, v_action, v_inst.tenant, v_target, p_reason, v_inputs,
                           'refused', v_why);
  END IF;
  UPDATE custody.instances SET dispatch_paused = p_paused, updated_at = now()
   WHERE id = v_inst.id;
  PERFORM custody.history_add(v_inst.id, NULL, 'dispatch.' || v_word, p_actor,
                              jsonb_build_object('reason', p_reason));
  RETURN custody.outcome(p_actor, v_action, v_inst.tenant, v_target, p_reason, v_inputs, 'done',
    format('effect dispatch %s for instance %s', v_word, p_instance),
    jsonb_build_object('instance_id', p_instance, 'dispatch_paused', p_paused));
END $$;

-- The cancellation transition of one locked, unsettled instance: unresolved operations
-- become cancelling (a cancel goes to each pinned executor) or cancelled (retry_waiting,
-- nothing in flight); pending successors are suppressed; the submits it makes
-- undeliverable are retired; the instance settles once every operation is authoritative.
CREATE OR REPLACE FUNCTION custody.cancel_in(
  p_actor text, p_instance uuid, p_reason text
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  r custody.operations;
  v_to custody.operation_status;
  v_cancelling text[] := '{}';
  v_cancelled text[] := '{}';
  v_intent record;
  v_settled boolean;
BEGIN
  -- the status as text: the instance by its key, never through instances_status (as the
  -- instance status changes of queries.sql)
  UPDATE custody.instances SET status = 'cancelling', updated_at = now()
   WHERE id = p_instance AND status::text IN ('running', 'suspended');
  FOR r IN SELECT * FROM custody.operations
            WHERE instance_id = p_instance AND status NOT IN ('succeeded', 'failed', 'cancelled')
            ORDER BY id FOR UPDATE LOOP
    IF r.status = 'cancelling' THEN
      v_to := r.status;  -- a repeated cancel re-sends the command, with a new deadline
      UPDATE custody.operations
         SET deadline_at = now() + make_interval(secs => deadline_seconds), updated_at = now()
       WHERE id = r.id;
    ELSE
      v_to := custody.next_status(r.status, 'cancel');
      IF v_to IS NULL THEN
        RAISE EXCEPTION 'cancel is not allowed from % (operation %)', r.status, r.id
          USING ERRCODE = 'CU002';
      END IF;
      UPDATE custody.operations
         SET status = v_to, updated_at = now(),
             effect = CASE WHEN v_to = 'cancelled' THEN 'none'::custody.effect ELSE effect END,
             finished_at = CASE WHEN v_to = 'cancelled' THEN now() END,
             -- the cancel's answer is awaited this long, then asked for again
             deadline_at = CASE WHEN v_to = 'cancelling'
                                THEN now() + make_interval(secs => deadline_seconds)
                                ELSE deadline_at END
       WHERE id = r.id AND status = r.status;
      IF NOT FOUND THEN
        PERFORM custody.changed_under_lock('operation ' || r.id);
      END IF;
    END IF;
    IF v_to = 'cancelled' THEN
      UPDATE custody.node_states SET status = 'cancelled', updated_at = now()
       WHERE operation_id = r.id AND status = 'active';
      v_cancelled := v_cancelled || r.id::text;
    ELSE
      PERFORM custody.issue_command(
        r.id, 'cancel', custody.next_sequence(r.id, r.attempt, 'cancel'), p_reason);
      v_cancelling := v_cancelling || r.id::text;
    END IF;
    PERFORM custody.history_add(r.instance_id, r.id, 'operation.' || v_to, p_actor,
      jsonb_build_object('from', r.status::text, 'reason', p_reason));
    PERFORM custody.t_retire_submits(p_actor, r.id);
  END LOOP;
  FOR v_intent IN
    UPDATE custody.successor_intents SET status = 'done', done_at = now()
     WHERE instance_id = p_instance AND status = 'pending'
    RETURNING from_operation_id, next_node
  LOOP
    PERFORM custody.history_add(p_instance, v_intent.from_operation_id, 'successor.suppressed',
      p_actor, jsonb_build_object('next_node', v_intent.next_node, 'cause', 'cancel'));
  END LOOP;
  PERFORM custody.history_add(p_instance, NULL, 'instance.cancelling', p_actor,
                              jsonb_build_object('reason', p_reason));
  UPDATE custody.instances SET status = 'cancelled', finished_at = now(), updated_at = now()
   WHERE id = p_instance AND status::text = 'cancelling'
     AND NOT EXISTS (SELECT 1 FROM custody.operations
                      WHERE instance_id = p_instance
                        AND status NOT IN ('succeeded', 'failed', 'cancelled'));
  v_settled := FOUND;
  IF v_settled THEN
    PERFORM custody.history_add(p_instance, NULL, 'instance.cancelled', p_actor, '{}');
  END IF;
  RETURN jsonb_build_object(
    'instance_id', p_instance::text,
    'instance_status', CASE WHEN v_settled THEN 'cancelled' ELSE 'cancelling' END,
    'cancelling', to_jsonb(v_cancelling),
    'cancelled', to_jsonb(v_cancelled));
END $$;

-- A cancel whose answer never came is asked again once its deadline passes, with a
-- doubling deadline: silence is not an answer, and it is never taken for a cancellation
-- either (the operation stays cancelling until authoritative evidence). The executor
-- answers a repeated cancel with the receipt it already holds.
CREATE OR REPLACE FUNCTION custody.t_resend_cancels(p_actor text, p_limit int)
RETURNS int LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  r custody.operations;
  v_sequence int;
  v_request uuid;
  n int := 0;
BEGIN
  FOR r IN SELECT * FROM custody.operations
            WHERE status = 'cancelling' AND deadline_at < now()
            ORDER BY deadline_at LIMIT p_limit
            FOR UPDATE SKIP LOCKED LOOP
    v_sequence := custody.next_sequence(r.id, r.attempt, 'cancel');
    v_request := custody.issue_command(
      r.id, 'cancel', v_sequence, 'the cancel was not answered before its deadline');
    UPDATE custody.operations
       SET deadline_at = now() + make_interval(
             secs => r.deadline_seconds * power(2, least(v_sequence - 1, 6))),
           updated_at = now()
     WHERE id = r.id;
    PERFORM custody.history_add(r.instance_id, r.id, 'operation.cancel_resent', p_actor,
      jsonb_build_object('cancel_request_id', v_request::text, 'sequence', v_sequence,
                         'cause', 'cancel unanswered'));
    n := n + 1;
  END LOOP;
  RETURN n;
END $$;

-- Cancel an instance: a request to settle its work consistently with the executors'
-- durable state. Repeating it re-sends the cancels.
CREATE OR REPLACE FUNCTION custody.t_cancel(p_actor text, p_instance text, p_reason text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_inputs jsonb := jsonb_build_object('instance_id', p_instance);
  v_inst custody.instances;
  v_why text;
  v_data jsonb;
BEGIN
  SELECT * INTO v_inst FROM custody.instances
   WHERE id = custody.canonical_id(p_instance) FOR UPDATE;
  IF NOT FOUND THEN
    RETURN custody.outcome(p_actor, 'cancel', NULL, p_instance, p_reason, v_inputs,
                           'not_found', format('no instance %s', p_instance));
  END IF;
  v_why := custody.refusal(p_actor, 'cancel', v_inst.tenant, p_reason);
  IF v_why IS NULL AND v_inst.status IN ('completed', 'failed', 'cancelled') THEN
    v_why := format('instance %s is already %s', v_inst.id, v_inst.status);
  END IF;
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'cancel', v_inst.tenant, p_instance, p_reason, v_inputs,
                           'refused', v_why);
  END IF;
  v_data := custody.cancel_in(p_actor, v_inst.id, p_reason);
  RETURN custody.outcome(p_actor, 'cancel', v_inst.tenant, p_instance, p_reason, v_inputs,
    'done',
    format('instance %s is %s; %s operation(s) cancelling', p_instance,
           v_data->>'instance_status', jsonb_array_length(v_data->'cancelling')),
    v_data);
END $$;

-- Cancel a start request: its instance if it exists, otherwise a durable tombstone, so
-- that a late start creates nothing. The advisory lock is the one a start takes.
CREATE OR REPLACE FUNCTION custody.t_cancel_start(
  p_actor text, p_tenant text, p_start_request text, p_reason text
) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_start uuid := custody.canonical_id(p_start_request);
  v_target text := p_tenant || '/' || coalesce(v_start::text, p_start_request);
  v_inputs jsonb := jsonb_build_object(
    'tenant', p_tenant, 'start_request_id', coalesce(v_start::text, p_start_request));
  v_inst custody.instances;
  v_why text;
  v_data jsonb;
BEGIN
  IF v_start IS NULL THEN
    RETURN custody.outcome(p_actor, 'cancel-start', NULL, v_target, p_reason, v_inputs,
      'not_found', format('''%s'' is not a start request id', p_start_request));
  END IF;
  v_why := custody.refusal(p_actor, 'cancel-start', p_tenant, p_reason);
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'cancel-start', p_tenant, v_target, p_reason, v_inputs,
                           'refused', v_why);
  END IF;
  PERFORM pg_advisory_xact_lock(hashtext(p_tenant || '/' || v_start::text));
  SELECT * INTO v_inst FROM custody.instances
   WHERE tenant = p_tenant AND start_request_id = v_start FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO custody.start_tombstones (tenant, start_request_id, actor, reason)
    VALUES (p_tenant, v_start, p_actor, p_reason) ON CONFLICT DO NOTHING;
    RETURN custody.outcome(p_actor, 'cancel-start', p_tenant, v_target, p_reason, v_inputs,
      'done', format('start %s is tombstoned: if it arrives, it creates nothing', v_start),
      jsonb_build_object('start_request_id', v_start::text, 'tombstoned', true));
  END IF;
  v_why := custody.refusal(p_actor, 'cancel', p_tenant, p_reason);
  IF v_why IS NULL AND v_inst.status IN ('completed', 'failed', 'cancelled') THEN
    v_why := format('instance %s is already %s', v_inst.id, v_inst.status);
  END IF;
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'cancel-start', p_tenant, v_target, p_reason, v_inputs,
                           'refused', v_why);
  END IF;
  v_data := custody.cancel_in(p_actor, v_inst.id, p_reason);
  RETURN custody.outcome(p_actor, 'cancel-start', p_tenant, v_target, p_reason, v_inputs,
    'done',
    format('start %s had created instance %s: it is %s', p_start_request, v_inst.id,
           v_data->>'instance_status'),
    v_data);
END $$;

-- The restore runbook (DESIGN §7): mark, reconcile in batches, resume.
CREATE OR REPLACE FUNCTION custody.t_restore_mark(p_actor text, p_reason text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_why text := custody.refusal(p_actor, 'restore', NULL, p_reason);
  v_generation int;
BEGIN
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'restore', NULL, 'mark-restored', p_reason, '{}',
                           'refused', v_why);
  END IF;
  UPDATE custody.control
     SET dispatch_paused = true, restore_generation = restore_generation + 1, updated_at = now()
  RETURNING restore_generation INTO v_generation;
  RETURN custody.outcome(p_actor, 'restore', NULL, 'mark-restored', p_reason, '{}', 'done',
    format('dispatch paused; restore generation is now %s', v_generation),
    jsonb_build_object('dispatch_paused', true, 'restore_generation', v_generation));
END $$;

-- One batch of `restore reconcile`: every operation of the restored state whose outcome
-- is not authoritative (cancelling included), not already asked, is queried at its
-- pinned executor. "A restored engine can predate an effect that already committed
-- elsewhere": dispatched and accepted become outcome_unknown; pending stays pending.
CREATE OR REPLACE FUNCTION custody.t_restore_reconcile(
  p_actor text, p_reason text, p_done uuid[], p_limit int
) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_why text := custody.refusal(p_actor, 'restore', NULL, p_reason);
  r custody.operations;
  v_status custody.operation_status;
  v_event text;
  v_request uuid;
  v_ids text[] := '{}';
BEGIN
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'restore', NULL, 'reconcile', p_reason, '{}',
                           'refused', v_why);
  END IF;
  FOR r IN SELECT * FROM custody.operations
            WHERE status NOT IN ('succeeded', 'failed', 'cancelled', 'retry_waiting')
              AND NOT (id = ANY (p_done))
            ORDER BY id LIMIT p_limit FOR UPDATE SKIP LOCKED LOOP
    v_status := r.status;
    IF v_status IN ('dispatched', 'accepted') THEN
      v_status := custody.next_status(r.status, 'restored');
      UPDATE custody.operations SET status = v_status, updated_at = now()
       WHERE id = r.id AND status = r.status;
      UPDATE custody.instances SET status = 'suspended', updated_at = now()
       WHERE id = r.instance_id AND status::text = 'running';
      PERFORM custody.history_add(r.instance_id, r.id, 'operation.outcome_unknown', p_actor,
        jsonb_build_object('from', r.status::text, 'cause', 'restore'));
    END IF;
    IF v_status IN ('outcome_unknown', 'reconcile_pending') THEN
      -- a restored reconcile_pending gets a fresh deadline for the new question
      UPDATE custody.operations
         SET status = 'reconcile_pending', updated_at = now(),
             deadline_at = now() + make_interval(secs => deadline_seconds)
       WHERE id = r.id AND status = v_status;
      v_event := 'operation.reconcile_pending';
    ELSE
      v_event := 'operation.queried';  -- pending and cancelling: only the question
    END IF;
    v_request := custody.issue_command(
      r.id, 'query', custody.next_sequence(r.id, r.attempt, 'query'), NULL);
    PERFORM custody.history_add(r.instance_id, r.id, v_event, p_actor,
      jsonb_build_object('from', v_status::text, 'cause', 'restore', 'reason', p_reason,
                         'query_request_id', v_request::text));
    v_ids := v_ids || r.id::text;
  END LOOP;
  RETURN custody.outcome(p_actor, 'restore', NULL, 'reconcile', p_reason, '{}', 'done',
    format('%s operation(s) queried', cardinality(v_ids)),
    jsonb_build_object('queried', cardinality(v_ids), 'ids', to_jsonb(v_ids)));
END $$;

CREATE OR REPLACE FUNCTION custody.t_restore_resume(p_actor text, p_reason text, p_force boolean)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_why text := custody.refusal(p_actor, 'resume', NULL, p_reason);
  v_inputs jsonb := jsonb_build_object('force', p_force);
  v_pending int;
BEGIN
  IF v_why IS NULL THEN
    SELECT count(*) INTO v_pending FROM custody.operations
     WHERE status IN ('reconcile_pending', 'cancelling');
    IF v_pending > 0 AND NOT p_force THEN
      v_why := format('%s operation(s) still wait for their executor''s answer '
                      '(reconcile_pending or cancelling); wait, or --force', v_pending);
    END IF;
  END IF;
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(p_actor, 'resume', NULL, 'restore', p_reason, v_inputs,
                           'refused', v_why);
  END IF;
  UPDATE custody.control SET dispatch_paused = false, updated_at = now();
  RETURN custody.outcome(p_actor, 'resume', NULL, 'restore', p_reason, v_inputs, 'done',
    'effect dispatch resumed in the database; restart publishers, committers and receipt '
    'consumers without CUSTODY_DISPATCH_PAUSED',
    jsonb_build_object('dispatch_paused', false, 'unanswered', v_pending));
END $$;

-- The operator-facing commands: the actor is the login, never an argument ---------------
CREATE OR REPLACE FUNCTION custody.reconcile(p_operation text, p_reason text) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_reconcile(custody.operator_actor(), p_operation, p_reason)
$$;
CREATE OR REPLACE FUNCTION custody.retry_safe(p_operation text, p_reason text) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_retry_safe(custody.operator_actor(), p_operation, p_reason)
$$;
CREATE OR REPLACE FUNCTION custody.set_paused(
  p_paused boolean, p_reason text, p_instance text DEFAULT NULL
) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_set_paused(custody.operator_actor(), p_paused, p_reason, p_instance)
$$;
CREATE OR REPLACE FUNCTION custody.cancel(p_instance text, p_reason text) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_cancel(custody.operator_actor(), p_instance, p_reason)
$$;
CREATE OR REPLACE FUNCTION custody.cancel_start(
  p_tenant text, p_start_request text, p_reason text
) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_cancel_start(custody.operator_actor(), p_tenant, p_start_request, p_reason)
$$;
CREATE OR REPLACE FUNCTION custody.restore_mark(p_reason text) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_restore_mark(custody.operator_actor(), p_reason)
$$;
CREATE OR REPLACE FUNCTION custody.restore_reconcile(
  p_reason text, p_done uuid[], p_limit int
) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_restore_reconcile(custody.operator_actor(), p_reason, p_done, p_limit)
$$;
CREATE OR REPLACE FUNCTION custody.restore_resume(p_reason text, p_force boolean) RETURNS jsonb
LANGUAGE sql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
  SELECT custody.t_restore_resume(custody.operator_actor(), p_reason, p_force)
$$;

-- Batches: one audit row for a batch of operator commands (`custody reconcile|retry-safe|
-- cancel|dispatch pause|resume` by filter). Each command of the batch went through its
-- own function above, in its own transaction, with its own audit row; the batch row's
-- counts are read from those rows (this login's, for these targets, since the batch
-- started), never taken from the caller's word.
CREATE OR REPLACE FUNCTION custody.batch_audit(
  p_action text, p_filter jsonb, p_reason text, p_targets text[], p_started timestamptz
) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_actor text := custody.operator_actor();
  v_selected int := (SELECT count(DISTINCT t) FROM unnest(p_targets) t);
  v_done int;
  v_refused int;
  v_not_found int;
  v_tenant text;
  v_result text;
  v_counts jsonb;
BEGIN
  IF NOT p_action = ANY (ARRAY['reconcile', 'retry-safe', 'cancel', 'pause', 'resume']) THEN
    RAISE EXCEPTION 'no batch of %', p_action USING ERRCODE = '22023';
  END IF;
  WITH latest AS (
    SELECT DISTINCT ON (a.target) a.target, a.outcome, a.tenant
      FROM custody.audit a
     WHERE a.actor = v_actor AND a.action = p_action AND a.target = ANY (p_targets)
       AND a.at >= p_started
     ORDER BY a.target, a.id DESC
  )
  SELECT count(*) FILTER (WHERE outcome = 'done'), count(*) FILTER (WHERE outcome = 'refused'),
         count(*) FILTER (WHERE outcome = 'not_found'),
         CASE WHEN count(DISTINCT tenant) = 1 AND count(tenant) = count(*) THEN min(tenant) END
    INTO v_done, v_refused, v_not_found, v_tenant
    FROM latest;
  v_counts := jsonb_build_object('selected', v_selected, 'done', v_done, 'refused', v_refused,
    'not_found', v_not_found, 'unrecorded', v_selected - v_done - v_refused - v_not_found);
  v_result := CASE WHEN v_done = v_selected THEN 'done'
                   WHEN v_done = 0 THEN 'refused' ELSE 'partial' END;
  INSERT INTO custody.audit (actor, action, tenant, target, reason, inputs, outcome)
  VALUES (v_actor, p_action, coalesce(p_filter->>'tenant', v_tenant), 'batch', p_reason,
          jsonb_build_object('filter', p_filter) || v_counts, v_result);
  -- the batch row is written whatever its commands' results: its own result is done
  RETURN jsonb_build_object('result', 'done',
    'message', format('batch %s: %s selected, %s done, %s refused, %s not found', p_action,
                      v_selected, v_done, v_refused, v_not_found),
    'data', v_counts || jsonb_build_object('outcome', v_result));
END $$;

-- Dead letters: a replay of a message of custody.dead-letters to its original exchange
-- and routing key (`custody dead-letters replay`) is authorized (action "replay"; a dead
-- letter belongs to no tenant it could prove, so only an operator of every tenant) and
-- audited. The CLI asks first (p_published false: a refusal is audited, a permission is
-- not), publishes with a confirm, then records the replay (p_published true) before it
-- acks the dead letter: a crash in between leaves a duplicate, which the consumers'
-- deterministic identities absorb, never a loss.
CREATE OR REPLACE FUNCTION custody.dead_letter_replay(
  p_message_id text, p_exchange text, p_routing_key text, p_reason text, p_detail jsonb,
  p_published boolean
) RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = custody, pg_temp AS $$
DECLARE
  v_actor text := custody.operator_actor();
  v_inputs jsonb := jsonb_build_object('message_id', p_message_id, 'exchange', p_exchange,
                                       'routing_key', p_routing_key)
                    || coalesce(p_detail, '{}');
  -- a dead letter the CLI will not replay (a receipt, an undecodable one) is refused
  -- and audited here too, with the CLI's reason
  v_why text := coalesce(custody.refusal(v_actor, 'replay', NULL, p_reason),
                         p_detail->>'unreplayable');
BEGIN
  IF v_why IS NOT NULL THEN
    RETURN custody.outcome(v_actor, 'replay', NULL, p_message_id, p_reason, v_inputs,
                           'refused', v_why);
  END IF;
  IF NOT p_published THEN
    RETURN jsonb_build_object('result', 'done', 'message', 'authorized', 'data', '{}'::jsonb);
  END IF;
  RETURN custody.outcome(v_actor, 'replay', NULL, p_message_id, p_reason, v_inputs, 'done',
    format('dead letter %s replayed to %s with routing key %s', p_message_id, p_exchange,
           p_routing_key),
    jsonb_build_object('message_id', p_message_id, 'exchange', p_exchange,
                       'routing_key', p_routing_key));
END $$;

-- Ownership and EXECUTE ---------------------------------------------------------------
DO $$
DECLARE f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
            WHERE p.pronamespace = 'custody'::regnamespace LOOP
    EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
  END LOOP;
  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
            WHERE p.pronamespace = 'custody'::regnamespace AND p.prosecdef LOOP
    EXECUTE format('ALTER FUNCTION %s OWNER TO custody_definer', f);
  END LOOP;
END $$;

-- Anyone who can log in may *ask*: a login that is no operator gets an audited refusal.
GRANT USAGE ON SCHEMA custody TO PUBLIC;
GRANT EXECUTE ON FUNCTION custody.reconcile(text, text), custody.retry_safe(text, text),
  custody.set_paused(boolean, text, text), custody.cancel(text, text),
  custody.cancel_start(text, text, text), custody.restore_mark(text),
  custody.restore_reconcile(text, uuid[], int), custody.restore_resume(text, boolean)
  TO PUBLIC;
GRANT EXECUTE ON FUNCTION custody.batch_audit(text, jsonb, text, text[], timestamptz),
  custody.dead_letter_replay(text, text, text, text, jsonb, boolean) TO PUBLIC;
-- the workers' automatic policies and engine-channel cancels
GRANT EXECUTE ON FUNCTION custody.t_reconcile(text, text, text),
  custody.t_retry_safe(text, text, text), custody.t_resend_cancels(text, int)
  TO custody_reconciler;
GRANT EXECUTE ON FUNCTION custody.t_cancel(text, text, text),
  custody.t_cancel_start(text, text, text, text) TO custody_committer;
GRANT EXECUTE ON FUNCTION custody.t_retire_submits(text, uuid) TO custody_publisher;
-- functions every role's queries use
GRANT EXECUTE ON FUNCTION custody.fence(text, bigint) TO custody_committer, custody_publisher,
  custody_receipts, custody_reconciler;
GRANT EXECUTE ON FUNCTION custody.changed_under_lock(text) TO custody_committer,
  custody_receipts;
GRANT EXECUTE ON FUNCTION custody.claimed_instances() TO custody_committer, custody_receipts;
GRANT EXECUTE ON FUNCTION custody.operations_lock(uuid[]),
  custody.revisions_seen(uuid[], integer[], integer[]), custody.receipt_instances_claim(uuid[])
  TO custody_receipts;
GRANT EXECUTE ON FUNCTION custody.instance_results() TO custody_committer, custody_receipts;
GRANT EXECUTE ON FUNCTION custody.operation_apply(jsonb), custody.node_finish(jsonb),
  custody.receipt_writes(jsonb, jsonb, jsonb, jsonb) TO custody_receipts;
GRANT EXECUTE ON FUNCTION custody.instance_finish(jsonb) TO custody_committer, custody_receipts;
GRANT EXECUTE ON FUNCTION custody.outbox_mark_dispatched(uuid[], text, text)
  TO custody_committer, custody_receipts, custody_publisher;
GRANT EXECUTE ON FUNCTION custody.visible_tenants() TO custody_operators;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA custody TO custody_definer;

-- What custody_definer's functions write --------------------------------------------------
GRANT SELECT, INSERT, UPDATE ON custody.operations, custody.instances, custody.node_states,
  custody.attempts, custody.outbox, custody.successor_intents, custody.start_tombstones,
  custody.control TO custody_definer;
GRANT SELECT, INSERT ON custody.history, custody.audit TO custody_definer;
GRANT SELECT ON custody.operators, custody.operation_events, custody.operation_transitions,
  custody.instance_transitions TO custody_definer;  -- the status guards read the last two
GRANT USAGE ON ALL SEQUENCES IN SCHEMA custody TO custody_definer;

-- Operators read; they write nothing ----------------------------------------------------
GRANT SELECT ON ALL TABLES IN SCHEMA custody TO custody_operators;
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA custody FROM custody_operators;
-- ... but a view runs with its owner's rights, past row-level security: an operator may
-- read only the views that run with the reader's (security_invoker), never one that
-- would show another tenant's rows
DO $$
DECLARE v regclass;
BEGIN
  FOR v IN SELECT c.oid::regclass FROM pg_class c
            WHERE c.relnamespace = 'custody'::regnamespace AND c.relkind IN ('v', 'm')
              AND coalesce(c.reloptions::text !~* 'security_invoker=(true|on|yes|1)', true)
  LOOP
    EXECUTE format('REVOKE ALL ON %s FROM custody_operators', v);
  END LOOP;
END $$;
DO $$
BEGIN
  -- the shared role of earlier releases, whose login could write recovery rows
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'custody_operator') THEN
    REVOKE ALL ON ALL TABLES IN SCHEMA custody FROM custody_operator;
    REVOKE ALL ON ALL SEQUENCES IN SCHEMA custody FROM custody_operator;
  END IF;
END $$;

-- Tenant isolation: row-level security ---------------------------------------------------
-- The workers and custody_definer see every row; an operator sees the rows of its tenants
-- (every tenant with "*"); rows of no tenant (global audit, undecodable quarantine) only
-- with "*". The table owner (the migrator) is not subject to it.
DO $$
DECLARE
  t text;
  everyone text := 'custody_committer, custody_publisher, custody_receipts, '
                   'custody_reconciler, custody_definer';
  -- the scalar subquery is evaluated once per query, not per row
  own_tenant text := '(SELECT custody.visible_tenants()) && ARRAY[''*'', tenant]';
  by_instance text := 'EXISTS (SELECT 1 FROM custody.instances i WHERE i.id = instance_id)';
  by_operation text := 'EXISTS (SELECT 1 FROM custody.operations o WHERE o.id = operation_id)';
BEGIN
  FOREACH t IN ARRAY ARRAY['instances', 'operations', 'start_tombstones', 'quarantine', 'audit',
                           'history', 'node_states', 'successor_intents', 'attempts', 'outbox',
                           'receipt_inbox'] LOOP
    EXECUTE format('ALTER TABLE custody.%I ENABLE ROW LEVEL SECURITY', t);
    EXECUTE format('DROP POLICY IF EXISTS workers ON custody.%I', t);
    EXECUTE format('CREATE POLICY workers ON custody.%I TO %s USING (true) WITH CHECK (true)',
                   t, everyone);
    EXECUTE format('DROP POLICY IF EXISTS operators ON custody.%I', t);
    EXECUTE format('CREATE POLICY operators ON custody.%I FOR SELECT TO custody_operators '
                   'USING (%s)', t,
                   CASE WHEN t IN ('instances', 'operations', 'start_tombstones', 'quarantine',
                                   'audit') THEN own_tenant
                        WHEN t IN ('history', 'node_states', 'successor_intents')
                          THEN by_instance
                        ELSE by_operation END);
  END LOOP;
END $$;

-- The archive (schema.sql): operators read their tenants' archived rows, as the hot ones
-- (the restore report looks up archived attempts too); nobody writes there but the
-- archiver's function.
GRANT USAGE ON SCHEMA custody_archive TO custody_operators;
GRANT SELECT ON ALL TABLES IN SCHEMA custody_archive TO custody_operators;
DO $$
DECLARE
  t text;
  own_tenant text := '(SELECT custody.visible_tenants()) && ARRAY[''*'', tenant]';
  by_instance text :=
    'EXISTS (SELECT 1 FROM custody_archive.instances i WHERE i.id = instance_id)';
  by_operation text :=
    'EXISTS (SELECT 1 FROM custody_archive.operations o WHERE o.id = operation_id)';
BEGIN
  FOREACH t IN ARRAY ARRAY['instances', 'operations', 'node_states', 'attempts', 'history',
                           'successor_intents'] LOOP
    EXECUTE format('ALTER TABLE custody_archive.%I ENABLE ROW LEVEL SECURITY', t);
    EXECUTE format('DROP POLICY IF EXISTS operators ON custody_archive.%I', t);
    EXECUTE format('CREATE POLICY operators ON custody_archive.%I FOR SELECT '
                   'TO custody_operators USING (%s)', t,
                   CASE WHEN t IN ('instances', 'operations') THEN own_tenant
                        WHEN t = 'attempts' THEN by_operation
                        ELSE by_instance END);
  END LOOP;
END $$;
