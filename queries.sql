-- Engine queries (search_path = custody), loaded by workers/io/sql.py together with
-- participant_queries.sql; a name is unique across the two files. Each group below is
-- the worker (or command) whose transactions run it: a commit boundary.
-- Every transition UPDATE names the expected current state: zero rows is a lost race.

-- Leases: every worker's fencing token (workers/io/db.py), each call its own transaction ---

-- name: lease_acquire
INSERT INTO custody.leases AS l (holder, worker, epoch, expires_at)
VALUES (%(holder)s, %(worker)s, 1, clock_timestamp() + make_interval(secs => %(ttl)s))
ON CONFLICT (holder) DO UPDATE
   SET epoch = l.epoch + 1, acquired_at = clock_timestamp(), expires_at = EXCLUDED.expires_at
RETURNING epoch;

-- name: lease_renew
UPDATE custody.leases
   SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
       renewed_at = clock_timestamp()
 WHERE holder = %(holder)s AND epoch = %(epoch)s AND expires_at > clock_timestamp();

-- name: lease_release
DELETE FROM custody.leases WHERE holder = %(holder)s AND epoch = %(epoch)s;

-- Shared writes: history and quarantine rows, inside the unit of work that writes them ----

-- name: history_insert
INSERT INTO history (instance_id, operation_id, event, detail, actor)
SELECT r.instance_id, r.operation_id, r.event, coalesce(r.detail, '{}'), r.actor
  FROM ROWS FROM (jsonb_to_recordset(%(rows)s)
                  AS (instance_id uuid, operation_id uuid, event text, detail jsonb, actor text))
       WITH ORDINALITY AS r(instance_id, operation_id, event, detail, actor, n)
 ORDER BY r.n;

-- name: quarantine_insert
INSERT INTO quarantine (source, reason, detail, message_id, user_id, tenant, operation_id,
                        body, headers, worker)
VALUES (%(source)s, %(reason)s, %(detail)s, %(message_id)s, %(user_id)s, %(tenant)s,
        %(operation_id)s, %(body)s, %(headers)s, %(worker)s);

-- Committer: a batch of start requests, or of successor intents, in one transaction -------

-- name: start_locks
-- Serialises a start request with its cancellation: exactly one of the two wins. The key
-- is the id's canonical spelling, whatever spelling the caller used.
SELECT pg_advisory_xact_lock(k)
  FROM (SELECT DISTINCT hashtext(t || '/' || s::uuid::text) AS k
          FROM unnest(%(tenant)s::text[], %(start_request_id)s::text[]) AS u(t, s)
         ORDER BY 1) AS keys;

-- name: start_tombstones_for
SELECT tenant, start_request_id::text FROM start_tombstones
 WHERE (tenant, start_request_id) IN (
       SELECT * FROM unnest(%(tenant)s::text[], %(start_request_id)s::uuid[]));

-- name: start_tombstone_late
UPDATE start_tombstones SET late_start_at = coalesce(late_start_at, now())
 WHERE tenant = %(tenant)s AND start_request_id = %(start_request_id)s;

-- name: start_archived_for
-- The starts of a run whose instances finished long ago and were archived: duplicates
-- (read under the start locks, which the archival takes too)
SELECT tenant, start_request_id::text FROM custody_archive.instances
 WHERE (tenant, start_request_id) IN (
       SELECT * FROM unnest(%(tenant)s::text[], %(start_request_id)s::uuid[]));

-- name: instance_insert
-- One statement for the batch, sent without waiting: every instance of the batch is new
-- (the start locks are held, and the instances and the archive were read under them), and
-- one that is there after all fails the statement (CU004: the unit is redone, and reads
-- it), so that nothing is written for a start this unit did not make.
WITH inserted AS (
  INSERT INTO instances (id, tenant, start_request_id, process, process_version, input,
                         status, requested_by, traceparent, routes)
  SELECT id, tenant, start_request_id, process, process_version, input, 'running',
         requested_by, traceparent, routes
    FROM jsonb_to_recordset(%(rows)s)
         AS t(id uuid, tenant text, start_request_id uuid, process text, process_version int,
              input jsonb, requested_by text, traceparent text, routes jsonb)
  ON CONFLICT DO NOTHING
  RETURNING id
)
SELECT custody.changed_under_lock('an instance of the batch')
 WHERE (SELECT count(*) FROM inserted) <> jsonb_array_length(%(rows)s);

-- name: instances_get
SELECT id::text, tenant, start_request_id::text, process, input, status::text
  FROM instances WHERE id = ANY(%(ids)s);

-- name: activation_insert
-- A batch's activations, in one statement: their nodes, operations, attempts and outbox
-- rows (in the batch's order), and the unit's history (in its order). The foreign keys
-- between them are checked at the end of the statement, with every row in.
-- A submit is queued already claimed by %(holder)s when given (the committer's own
-- sender, which publishes it right after this commit: no wake-up, no claim transaction)
-- when the claim would take it now (outbox_claim): dispatch not paused, globally, for
-- this worker (%(held)s) or for the instance, and the instance running (the committer
-- holds its row lock). Otherwise it is queued unclaimed, for the publisher's claim, as
-- is a claimed one whose sender dies first (once the claim expires). Returns the ids
-- queued claimed.
WITH n AS (
  INSERT INTO node_states (instance_id, node, activation, operation_id, status)
  SELECT r.instance_id, r.node, r.activation, r.operation_id, 'active'
    FROM jsonb_to_recordset(%(nodes)s)
         AS r(instance_id uuid, node text, activation integer, operation_id uuid)
), o AS (
  INSERT INTO operations (id, tenant, instance_id, node, activation, operation, route, owner,
                          principal, binding, input, lineage, attempt, digest, status, effect,
                          deadline_seconds)
  SELECT r.id, r.tenant, r.instance_id, r.node, r.activation, r.operation, r.route, r.owner,
         r.principal, r.binding, r.input, r.lineage, r.attempt, r.digest, 'pending', 'unknown',
         r.deadline_seconds
    FROM jsonb_to_recordset(%(operations)s)
         AS r(id uuid, tenant text, instance_id uuid, node text, activation integer,
              operation text, route text, owner text, principal text, binding text,
              input jsonb, lineage jsonb, attempt integer, digest text, deadline_seconds integer)
), a AS (
  INSERT INTO attempts (request_id, operation_id, attempt, kind, digest)
  SELECT r.request_id, r.operation_id, r.attempt, r.kind, r.digest
    FROM jsonb_to_recordset(%(attempts)s)
         AS r(request_id uuid, operation_id uuid, attempt integer, kind text, digest text)
), x AS (
  INSERT INTO outbox (id, kind, exchange, routing_key, body, headers, operation_id,
                      claimed_by, claim_expires_at, publish_attempts)
  SELECT r.id, r.kind, r.exchange, r.routing_key, decode(r.body, 'base64'), r.headers,
         r.operation_id, c.holder, c.expires, CASE WHEN c.holder IS NULL THEN 0 ELSE 1 END
    FROM ROWS FROM (jsonb_to_recordset(%(outbox)s)
                    AS (id uuid, kind text, exchange text, routing_key text, body text,
                        headers jsonb, operation_id uuid, instance_id uuid))
         WITH ORDINALITY AS r(id, kind, exchange, routing_key, body, headers, operation_id,
                              instance_id, n)
         LEFT JOIN LATERAL (
           SELECT %(holder)s::text AS holder,
                  clock_timestamp() + make_interval(secs => %(ttl)s::float8) AS expires
            WHERE %(holder)s::text IS NOT NULL AND r.kind = 'submit' AND NOT %(held)s::bool
              AND NOT (SELECT dispatch_paused FROM control)
              AND (SELECT i.status = 'running' AND NOT i.dispatch_paused
                     FROM instances i WHERE i.id = r.instance_id)
         ) c ON true
   ORDER BY r.n
  RETURNING id, claimed_by
), h AS (
  INSERT INTO history (instance_id, operation_id, event, detail, actor)
  SELECT r.instance_id, r.operation_id, r.event, coalesce(r.detail, '{}'), r.actor
    FROM ROWS FROM (jsonb_to_recordset(%(history)s)
                    AS (instance_id uuid, operation_id uuid, event text, detail jsonb,
                        actor text))
         WITH ORDINALITY AS r(instance_id, operation_id, event, detail, actor, n)
   ORDER BY r.n
)
SELECT id::text FROM x WHERE claimed_by IS NOT NULL;

-- name: successor_claim
-- The instance row is locked with the intent: cancel takes the same lock, so the status
-- read here is the one the new work is committed under (a cancel that commits first is
-- seen; one that comes later sees the new operation and cancels it).
-- The claimed instances' ids are kept for the rest of the transaction in the
-- transaction-local setting custody.claimed_instances, which instance_results and
-- node_activations read: they leave with this statement, in the same round trip, and
-- each still runs after it, under a snapshot taken after its locks. They read the ids
-- once, as a sub-select (an init plan): called in a filter, custody.claimed_instances()
-- parsed every id again for each row a scan passed (456 ms for 7,500 node_states rows
-- and 200 ids, on a table not yet analysed, where the planner chose a full scan).
WITH c AS (
  SELECT s.id, s.instance_id, s.from_operation_id, s.outcome, s.next_node,
         i.tenant, i.status::text AS instance_status, i.suspended_reason, i.process,
         i.process_version, i.input, i.traceparent, i.routes
    FROM successor_intents s JOIN instances i ON i.id = s.instance_id
   WHERE s.status = 'pending' AND (s.not_before IS NULL OR s.not_before <= now())
     AND (i.status <> 'suspended' OR i.suspended_reason = 'definition_missing')
   ORDER BY s.id
   LIMIT %(limit)s
     FOR UPDATE OF s, i SKIP LOCKED
), kept AS (
  SELECT set_config('custody.claimed_instances',
                    coalesce(string_agg(DISTINCT instance_id::text, ','), ''), true)
    FROM c
)
SELECT c.* FROM c CROSS JOIN kept ORDER BY c.id;

-- name: successor_defer
UPDATE successor_intents SET not_before = now() + make_interval(secs => %(delay)s)
 WHERE id = %(id)s AND status = 'pending';

-- name: instance_suspend_for
-- An instance's status change compares its status as text (here and below): no index
-- serves that, so the instance is reached by its key whatever the statistics say of
-- the live statuses (instances_status would be read in full for a status they call
-- rare: test_query_plans.py::test_an_instance_status_change_reaches_its_instance_…)
UPDATE instances SET status = 'suspended', suspended_reason = %(reason)s, updated_at = now()
 WHERE id = %(id)s AND status::text = 'running';

-- name: instance_resume_from
UPDATE instances SET status = 'running', suspended_reason = NULL, updated_at = now()
 WHERE id = %(id)s AND status::text = 'suspended' AND suspended_reason = %(reason)s;

-- name: instance_results
-- planned once, by its keys (custody.instance_results in transitions.sql): the results of
-- the instances successor_claim (or receipt_instances_claim) locked, in this transaction
SELECT * FROM custody.instance_results();

-- name: node_activations
-- (the instances successor_claim locked, in this transaction)
SELECT instance_id, node, max(activation) AS activation FROM node_states
 WHERE instance_id = ANY((SELECT custody.claimed_instances())::uuid[])
 GROUP BY instance_id, node;

-- name: successor_done
UPDATE successor_intents SET status = 'done', done_at = now()
 WHERE id = ANY(%(ids)s) AND status = 'pending';

-- name: instance_finish
-- planned once, by its keys (custody.instance_finish in transitions.sql, a row at a time):
-- a batch's ends, each only from running, with the history row of each end given one;
-- returns the instances ended
SELECT id FROM custody.instance_finish(%(rows)s);

-- Publisher: claim a batch (one transaction), publish, mark the confirmed ones (another) ---

-- name: outbox_claim
-- Effect dispatch (submits) waits while dispatch is paused, globally or for the
-- instance; queries and cancels still flow (the restore runbook reconciles while paused).
-- A submit is dispatched only for its operation's current attempt, while that operation
-- is in flight and its instance running: a suspended instance's submit is held, a
-- settled or cancelling operation's is never sent (submits_retire retires it). A submit
-- the committer queued claimed by its own sender (activation_insert), checked the same
-- way at its commit, leaves from there within half its claim's life (or not at all:
-- then this claim takes it once the claim expired, with these checks).
UPDATE outbox o
   SET claimed_by = %(holder)s,
       claim_expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
       publish_attempts = o.publish_attempts + 1
 WHERE o.id IN (SELECT b.id FROM outbox b
                 WHERE b.status = 'pending' AND b.next_attempt_at <= now()
                   AND (b.claim_expires_at IS NULL OR b.claim_expires_at < clock_timestamp())
                   AND (b.kind <> 'submit' OR (
                        NOT %(held)s AND NOT (SELECT dispatch_paused FROM control)
                        AND EXISTS (SELECT 1 FROM operations op
                                      JOIN attempts a ON a.request_id = b.id
                                     WHERE op.id = b.operation_id AND a.attempt = op.attempt
                                       AND op.status IN ('pending', 'dispatched', 'accepted')
                                       -- the instance by its key, always: a join here let a
                                       -- plan cached on young tables read every running
                                       -- instance through instances_status per row
                                       AND (SELECT i.status = 'running' AND NOT i.dispatch_paused
                                              FROM instances i WHERE i.id = op.instance_id))))
                 ORDER BY b.next_attempt_at
                 LIMIT %(limit)s
                   FOR UPDATE OF b SKIP LOCKED)
RETURNING o.id, o.kind, o.exchange, o.routing_key, o.body, o.headers, o.operation_id,
          o.publish_attempts;

-- name: outbox_mark_published
UPDATE outbox
   SET status = 'published', published_at = now(), claimed_by = NULL,
       claim_expires_at = NULL, last_error = NULL
 WHERE id = ANY(%(ids)s) AND claimed_by = %(holder)s AND status = 'pending'
RETURNING id, operation_id;

-- name: outbox_release
UPDATE outbox
   SET claimed_by = NULL, claim_expires_at = NULL, last_error = %(error)s,
       next_attempt_at = now() + make_interval(secs => %(delay)s)
 WHERE id = %(id)s AND claimed_by = %(holder)s AND status = 'pending';

-- name: outbox_unclaim
-- Claims given back unsent (a stopping participant's or committer's rows, handed to the
-- publisher in its process).
UPDATE outbox SET claimed_by = NULL, claim_expires_at = NULL
 WHERE id = ANY(%(ids)s::uuid[]) AND claimed_by = %(holder)s AND status = 'pending';

-- name: outbox_stats
-- The outbox gauges, of the engine's outbox or a participant's (same view name in both
-- schemas): the rows waiting to be sent or confirmed, and the age of the oldest. A
-- submit held by a dispatch pause or a suspended instance waits on purpose: not counted.
SELECT count(*) FILTER (WHERE NOT held) AS pending,
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE NOT held)), 0)::float8
         AS oldest_age_s
  FROM outbox_pending_rows;

-- name: outbox_mark_dispatched
-- planned once, by its keys (custody.outbox_mark_dispatched in transitions.sql, a row at
-- a time): the engine's confirm mark, the rows this publisher's claim holds marked
-- published and the current attempt's confirmed submits dispatching their operations;
-- returns how many rows it marked
SELECT custody.outbox_mark_dispatched(%(ids)s::uuid[], %(holder)s, %(actor)s) AS marked;

-- Receipt consumer: a batch of receipts and cancellations applied in one transaction ------

-- name: operations_lock
-- planned once, by its keys (custody.operations_lock in transitions.sql): what a receipt
-- is judged and applied by, no more (decoding the operation's input and lineage jsonb was
-- a tenth of the receipt consumer's row reading), its operation locked
SELECT * FROM custody.operations_lock(%(ids)s::uuid[]);

-- name: attempts_for
SELECT request_id::text, operation_id::text, attempt, kind, digest
  FROM attempts WHERE request_id = ANY(%(ids)s);

-- name: receipts_seen
SELECT receipt_id::text, content_hash FROM receipt_inbox WHERE receipt_id = ANY(%(ids)s);

-- name: revisions_seen
-- planned once, by its keys (custody.revisions_seen in transitions.sql): every
-- (operation, attempt, owner revision) already recorded, with its content
SELECT * FROM custody.revisions_seen(%(operation_id)s::uuid[], %(attempt)s::int[],
                                      %(owner_revision)s::int[]);

-- name: receipt_writes
-- planned once, by its keys (custody.receipt_writes in transitions.sql): a receipt batch's
-- writes in one call, each a jsonb array of row objects (empty where the batch has none):
-- the receipts' identities, the operations' changes (each operation at most once,
-- records.fold_updates; each guarded by the status it was judged from: a row changed
-- under its lock fails the call, CU004, the unit is redone, so that the caller need not
-- wait for a row count), their finished nodes, the successor intents
SELECT custody.receipt_writes(%(receipts)s, %(updates)s, %(nodes)s, %(successors)s);

-- name: receipt_instances_claim
-- planned once, by its keys (custody.receipt_instances_claim in transitions.sql): the
-- instances of a batch's terminal receipts, locked where free, after its operations;
-- their ids kept in the transaction for instance_results and node_activations
SELECT * FROM custody.receipt_instances_claim(%(ids)s::uuid[]);

-- name: instance_suspend
UPDATE instances SET status = 'suspended', updated_at = now()
 WHERE id = %(id)s AND status::text = 'running';

-- name: instance_unsuspend
-- Progress resumes once no operation of the instance is left without an outcome.
UPDATE instances SET status = 'running', suspended_reason = NULL, updated_at = now()
 WHERE id = %(id)s AND status::text = 'suspended'
   AND NOT EXISTS (SELECT 1 FROM operations
                    WHERE instance_id = %(id)s
                      AND status IN ('outcome_unknown', 'reconcile_pending'));

-- name: instance_set_cancelling
UPDATE instances SET status = 'cancelling', updated_at = now()
 WHERE id = %(id)s AND status::text IN ('running', 'suspended');

-- name: instance_settle_cancel
-- A cancelling instance is cancelled once every operation has authoritative evidence.
UPDATE instances SET status = 'cancelled', finished_at = now(), updated_at = now()
 WHERE id = %(id)s AND status::text = 'cancelling'
   AND NOT EXISTS (SELECT 1 FROM operations
                    WHERE instance_id = %(id)s
                      AND status NOT IN ('succeeded', 'failed', 'cancelled'));

-- Reconciler: deadlines, retries and unknown outcomes, one transaction per sweep ----------

-- name: operations_overdue
-- The in-flight operations past their deadline, oldest deadline first. One scan per
-- status, each in deadline order through operations_open (status, deadline_at) and
-- stopped at the limit: a sweep reads the rows it takes, never every overdue or open
-- operation. (With the three statuses in one IN list, no index gives deadline order:
-- the planner read every match and sorted it, O(overdue) per batch after an outage,
-- and read the whole table when its statistics called most operations open.) Up to the
-- limit of each status, and every row locked is returned: the sweep moves all it
-- locks, so no row stays locked without being moved.
WITH pending AS (
    SELECT id, instance_id, status, deadline_at FROM operations
     WHERE status = 'pending' AND deadline_at < now()
     ORDER BY deadline_at LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED),
dispatched AS (
    SELECT id, instance_id, status, deadline_at FROM operations
     WHERE status = 'dispatched' AND deadline_at < now()
     ORDER BY deadline_at LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED),
accepted AS (
    SELECT id, instance_id, status, deadline_at FROM operations
     WHERE status = 'accepted' AND deadline_at < now()
     ORDER BY deadline_at LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED)
SELECT id, instance_id, status FROM (
    SELECT * FROM pending UNION ALL SELECT * FROM dispatched UNION ALL SELECT * FROM accepted
) overdue
 ORDER BY deadline_at;

-- name: queries_overdue
SELECT id, instance_id, status::text FROM operations
 WHERE status = 'reconcile_pending' AND deadline_at < now()
 ORDER BY deadline_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: operation_set_status
-- The status as text: the operation by its key, never every operation of that status
-- through operations_open (see instance_suspend_for)
UPDATE operations SET status = %(status)s, updated_at = now()
 WHERE id = %(id)s AND status::text = %(expected)s;

-- name: retries_due
SELECT id FROM operations
 WHERE status = 'retry_waiting' AND retry_at <= now()
 ORDER BY retry_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: unknown_due
-- Automatic reconcile policy: outcome_unknown for longer than a backoff that doubles
-- with every query already issued for the attempt.
SELECT o.id FROM operations o
 WHERE o.status = 'outcome_unknown'
   AND o.updated_at < now() - make_interval(secs => %(base)s * power(2, least(
         (SELECT count(*) FROM attempts a
           WHERE a.operation_id = o.id AND a.attempt = o.attempt AND a.kind = 'query'), 10)))
 ORDER BY o.updated_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: successor_intents_pending
SELECT count(*) AS n FROM successor_intents WHERE status = 'pending';

-- name: dispatch_stats
-- The reconciler's dispatch gauges: the database's pause flag, the unfinished instances
-- whose dispatch is paused (instances_dispatch_paused), and the submits held back.
SELECT (SELECT dispatch_paused FROM control) AS paused,
       (SELECT count(*) FROM instances WHERE dispatch_paused
           AND status NOT IN ('completed', 'failed', 'cancelled')) AS paused_instances,
       (SELECT count(*) FROM outbox_pending_rows WHERE held) AS held;

-- name: operations_by_status
SELECT status::text, count(*) AS n FROM operations GROUP BY status;

-- name: operations_open_by_status
-- The reconciler's gauge on every poll: the live operations only, through their
-- partial index (the same predicate as operations_open); the settled ones are counted
-- far less often (operations_by_status), as their table only grows.
SELECT status::text, count(*) AS n FROM operations
 WHERE status NOT IN ('succeeded', 'failed', 'cancelled')
 GROUP BY status;

-- Retention (the reconciler, custody retention): bounded deletes, one transaction each ----

-- name: retention_receipts
-- Receipts older than the horizon, unless their operation is still unsettled (a receipt
-- of an operation that is archived, or that never existed, goes too).
-- (Each retention delete takes the oldest rows first, through the index on the time
-- column it filters (schema.sql, "Data lifecycle"), and deletes them by primary key: a
-- `ctid IN (...)` is a hash join that reads the whole table.)
DELETE FROM receipt_inbox r
 WHERE r.receipt_id = ANY(ARRAY(SELECT r2.receipt_id FROM receipt_inbox r2
                   WHERE r2.received_at < now() - make_interval(secs => %(horizon)s)
                     AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.id = r2.operation_id
                                       AND o.status NOT IN ('succeeded', 'failed', 'cancelled'))
                   ORDER BY r2.received_at
                   LIMIT %(limit)s));

-- name: retention_outbox
-- Sent rows after the horizon (a participant's too: the same table in its schema).
DELETE FROM outbox WHERE id = ANY(ARRAY(
  SELECT id FROM outbox
   WHERE status = 'published' AND published_at < now() - make_interval(secs => %(horizon)s)
   ORDER BY published_at
   LIMIT %(limit)s));

-- name: retention_outbox_retired
-- Retired rows (never sent) once as old.
DELETE FROM outbox WHERE id = ANY(ARRAY(
  SELECT id FROM outbox
   WHERE status = 'retired' AND created_at < now() - make_interval(secs => %(horizon)s)
   ORDER BY created_at
   LIMIT %(limit)s));

-- name: retention_quarantine
DELETE FROM quarantine WHERE id = ANY(ARRAY(
  SELECT id FROM quarantine WHERE received_at < now() - make_interval(secs => %(horizon)s)
   ORDER BY received_at
   LIMIT %(limit)s));

-- name: retention_archive
-- Finished instances past the archive horizon move to custody_archive with their
-- operations, node states, attempts, history and successor intents (schema.sql, "The
-- archive"): at most `limit` instances, in one statement of the caller's transaction.
SELECT custody_archive.move_finished(%(horizon)s, %(limit)s) AS n;

-- Controlled commands (transitions.sql), one transaction each: op_* operator, t_* worker ---

-- name: op_reconcile
SELECT custody.reconcile(%(target)s, %(reason)s) AS outcome;

-- name: t_reconcile
SELECT custody.t_reconcile(%(actor)s, %(target)s, %(reason)s) AS outcome;

-- name: op_retry_safe
SELECT custody.retry_safe(%(target)s, %(reason)s) AS outcome;

-- name: t_retry_safe
SELECT custody.t_retry_safe(%(actor)s, %(target)s, %(reason)s) AS outcome;

-- name: op_set_paused
SELECT custody.set_paused(%(paused)s, %(reason)s, %(instance)s) AS outcome;

-- name: t_set_paused
SELECT custody.t_set_paused(%(actor)s, %(paused)s, %(reason)s, %(instance)s) AS outcome;

-- name: op_cancel
SELECT custody.cancel(%(target)s, %(reason)s) AS outcome;

-- name: t_cancel
SELECT custody.t_cancel(%(actor)s, %(target)s, %(reason)s) AS outcome;

-- name: op_cancel_start
SELECT custody.cancel_start(%(tenant)s, %(target)s, %(reason)s) AS outcome;

-- name: t_cancel_start
SELECT custody.t_cancel_start(%(actor)s, %(tenant)s, %(target)s, %(reason)s) AS outcome;

-- name: op_restore_mark
SELECT custody.restore_mark(%(reason)s) AS outcome;

-- name: t_restore_mark
SELECT custody.t_restore_mark(%(actor)s, %(reason)s) AS outcome;

-- name: op_restore_reconcile
SELECT custody.restore_reconcile(%(reason)s, %(done)s::uuid[], %(limit)s) AS outcome;

-- name: t_restore_reconcile
SELECT custody.t_restore_reconcile(%(actor)s, %(reason)s, %(done)s::uuid[], %(limit)s) AS outcome;

-- name: op_restore_resume
SELECT custody.restore_resume(%(reason)s, %(force)s) AS outcome;

-- name: t_restore_resume
SELECT custody.t_restore_resume(%(actor)s, %(reason)s, %(force)s) AS outcome;

-- name: t_retire_submits
SELECT custody.t_retire_submits(%(actor)s, %(operation_id)s::uuid) AS n;

-- name: t_resend_cancels
SELECT custody.t_resend_cancels(%(actor)s, %(limit)s) AS n;

-- Operators file (custody migrate, custody operators apply): one transaction --------------

-- name: operators_sync
-- deploy/operators.toml into the database (custody migrate, custody operators apply)
INSERT INTO custody.operators (name, actions, tenants, updated_at)
VALUES (%(name)s, %(actions)s, %(tenants)s, now())
ON CONFLICT (name) DO UPDATE
   SET actions = EXCLUDED.actions, tenants = EXCLUDED.tenants, updated_at = now();

-- name: operators_prune
DELETE FROM custody.operators WHERE NOT (name = ANY(%(names)s));

-- Operator reads (the CLI, custody restore): read-only, one transaction per command -------

-- name: control_get
SELECT dispatch_paused, restore_generation FROM custody.control;

-- name: instance_list
SELECT id, tenant, process, process_version, status, created_at, finished_at
  FROM instances
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
 ORDER BY created_at DESC LIMIT %(limit)s;

-- name: instance_get
SELECT id::text, tenant, process, process_version, status::text, dispatch_paused, input,
       created_at, finished_at
  FROM instances WHERE id = %(id)s;

-- name: instance_operations
SELECT id, node, activation, operation, route, binding, attempt, status::text, effect::text,
       owner_revision, result, error, deadline_at, retry_at
  FROM operations WHERE instance_id = %(id)s ORDER BY created_at;

-- name: instance_history
SELECT id, operation_id, event, detail, actor, at FROM history
 WHERE instance_id = %(id)s ORDER BY id;

-- name: operation_list
SELECT id, tenant, instance_id, node, operation, route, binding, attempt, status, effect,
       owner_revision, created_at, finished_at
  FROM operations
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
   AND (%(route)s::text IS NULL OR route = %(route)s)
 ORDER BY created_at DESC LIMIT %(limit)s;

-- name: operation_get
SELECT id, tenant, instance_id, node, activation, operation, route, owner, principal, binding,
       input, attempt, digest, status::text, effect::text, owner_revision, result, error,
       deadline_at, retry_at, created_at, finished_at
  FROM operations WHERE id = %(id)s;

-- name: operation_attempts
SELECT request_id, attempt, kind, digest, created_at FROM attempts
 WHERE operation_id = %(id)s ORDER BY created_at;

-- name: operation_receipts
SELECT receipt_id, attempt, owner_revision, status, decision, received_at FROM receipt_inbox
 WHERE operation_id = %(id)s ORDER BY received_at;

-- name: quarantine_list
SELECT id, source, reason, detail, message_id, user_id, tenant, operation_id, received_at
  FROM quarantine
 WHERE (%(reason)s::text IS NULL OR reason = %(reason)s)
 ORDER BY id DESC LIMIT %(limit)s;

-- name: audit_list
SELECT id, at, actor, action, tenant, target, reason, outcome FROM audit
 ORDER BY id DESC LIMIT %(limit)s;

-- name: workers_list
-- the fleet as its leases show it: each holder's last heartbeat (renewal or acquisition)
SELECT holder, worker, epoch, acquired_at,
       greatest(acquired_at, renewed_at) AS last_heartbeat, expires_at,
       expires_at > clock_timestamp() AS live
  FROM leases ORDER BY worker, holder;

-- name: quarantine_stats
-- counts grouped by the columns named in %(by)s (the others are NULL: one static query)
SELECT CASE WHEN 'reason' = ANY(%(by)s) THEN reason END AS reason,
       CASE WHEN 'tenant' = ANY(%(by)s) THEN tenant END AS tenant,
       CASE WHEN 'source' = ANY(%(by)s) THEN source END AS source,
       CASE WHEN 'worker' = ANY(%(by)s) THEN worker END AS worker,
       count(*) AS n, max(received_at) AS last_at
  FROM quarantine
 GROUP BY 1, 2, 3, 4 ORDER BY n DESC, 1, 2, 3, 4;

-- Operator batches (custody reconcile|retry-safe|cancel|dispatch by filter): the filter
-- runs as the operator's own login, so row-level security confines it to its tenants;
-- each target then goes through its op_* command above, one transaction each, and the
-- batch gets one audit row (op_batch_audit). `matched` counts the whole filtered set.

-- name: batch_started
SELECT clock_timestamp() AS at;

-- name: batch_operations
SELECT id::text AS id, tenant, instance_id::text AS instance_id, node, route,
       status::text AS status, updated_at, count(*) OVER () AS matched
  FROM operations
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s)
   AND (%(route)s::text IS NULL OR route = %(route)s)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
   AND (%(since)s::float8 IS NULL OR updated_at >= now() - make_interval(secs => %(since)s))
 ORDER BY updated_at, id LIMIT %(limit)s;

-- name: batch_instances
SELECT id::text AS id, tenant, process, status::text AS status, dispatch_paused, created_at,
       count(*) OVER () AS matched
  FROM instances
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
   AND (%(process)s::text IS NULL OR process = %(process)s)
   AND (%(since)s::float8 IS NULL OR created_at >= now() - make_interval(secs => %(since)s))
 ORDER BY created_at, id LIMIT %(limit)s;

-- name: op_batch_audit
SELECT custody.batch_audit(%(action)s, %(filter)s, %(reason)s, %(targets)s::text[],
                           %(started)s) AS outcome;

-- name: op_dead_letter_replay
SELECT custody.dead_letter_replay(%(message_id)s, %(exchange)s, %(routing_key)s, %(reason)s,
                                  %(detail)s, %(published)s) AS outcome;

-- name: attempts_known
-- Archived attempts are known too: the engine settled them before the archive horizon.
SELECT request_id::text FROM attempts WHERE request_id = ANY(%(ids)s)
UNION ALL
SELECT request_id::text FROM custody_archive.attempts WHERE request_id = ANY(%(ids)s);

-- Harness reads (the demo, the bench: workers.harness.env) --------------------------------

-- name: harness_outbox_pending
SELECT count(*) AS n FROM outbox WHERE status = 'pending';

-- name: harness_quarantined
SELECT count(*) AS n FROM quarantine;

-- name: harness_succeeded_by_operation
SELECT operation, count(*) AS n FROM operations WHERE status = 'succeeded' GROUP BY 1;

-- name: instances_by_status
SELECT status::text, count(*) AS n FROM instances GROUP BY status;
