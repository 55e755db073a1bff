-- Named queries, loaded by workers/db.py. Engine queries run with
-- search_path = custody; participant queries (prefix p_) with the participant's
-- schema. The outbox queries serve both: the two outbox tables have one shape.
-- Every transition UPDATE names the expected current state: zero rows is a lost race.

-- name: lease_acquire
INSERT INTO custody.leases AS l (holder, worker, epoch, expires_at)
VALUES (%(holder)s, %(worker)s, 1, clock_timestamp() + make_interval(secs => %(ttl)s))
ON CONFLICT (holder) DO UPDATE
   SET epoch = l.epoch + 1, acquired_at = clock_timestamp(), expires_at = EXCLUDED.expires_at
RETURNING epoch;

-- name: lease_renew
UPDATE custody.leases
   SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
 WHERE holder = %(holder)s AND epoch = %(epoch)s AND expires_at > clock_timestamp();

-- name: lease_release
DELETE FROM custody.leases WHERE holder = %(holder)s AND epoch = %(epoch)s;

-- name: control_get
SELECT dispatch_paused, restore_generation FROM custody.control;

-- name: instance_insert
-- One statement for the batch. A replica that raced us to the same start request
-- wins quietly: its id is simply not returned, and we write nothing for it.
INSERT INTO instances (id, tenant, start_request_id, process, process_version, input, status,
                       requested_by, traceparent, routes)
SELECT id, tenant, start_request_id, process, process_version, input, 'running', requested_by,
       traceparent, routes
  FROM unnest(%(id)s::uuid[], %(tenant)s::text[], %(start_request_id)s::uuid[],
              %(process)s::text[], %(process_version)s::int[], %(input)s::jsonb[],
              %(requested_by)s::text[], %(traceparent)s::text[], %(routes)s::jsonb[])
       AS t(id, tenant, start_request_id, process, process_version, input, requested_by,
            traceparent, routes)
ON CONFLICT DO NOTHING
RETURNING id::text;

-- name: instances_get
SELECT id::text, tenant, start_request_id::text, process, input, status::text
  FROM instances WHERE id = ANY(%(ids)s);

-- name: node_insert
INSERT INTO node_states (instance_id, node, activation, operation_id, status)
VALUES (%(instance_id)s, %(node)s, %(activation)s, %(operation_id)s, 'active');

-- name: operation_insert
INSERT INTO operations (id, tenant, instance_id, node, activation, operation, route, owner,
                        principal, binding, input, lineage, attempt, digest, status, effect,
                        deadline_seconds)
VALUES (%(id)s, %(tenant)s, %(instance_id)s, %(node)s, %(activation)s, %(operation)s, %(route)s,
        %(owner)s, %(principal)s, %(binding)s, %(input)s, %(lineage)s, %(attempt)s, %(digest)s,
        'pending', 'unknown', %(deadline_seconds)s);

-- name: attempt_insert
INSERT INTO attempts (request_id, operation_id, attempt, kind, digest)
VALUES (%(request_id)s, %(operation_id)s, %(attempt)s, %(kind)s, %(digest)s);

-- name: outbox_insert
INSERT INTO outbox (id, kind, exchange, routing_key, body, headers, operation_id)
VALUES (%(id)s, %(kind)s, %(exchange)s, %(routing_key)s, %(body)s, %(headers)s::jsonb,
        %(operation_id)s);

-- name: history_insert
INSERT INTO history (instance_id, operation_id, event, detail, actor)
VALUES (%(instance_id)s, %(operation_id)s, %(event)s, %(detail)s, %(actor)s);

-- name: successor_claim
-- The instance row is locked with the intent: cancel takes the same lock, so the status
-- read here is the one the new work is committed under (a cancel that commits first is
-- seen; one that comes later sees the new operation and cancels it).
SELECT s.id, s.instance_id, s.from_operation_id, s.outcome, s.next_node,
       i.tenant, i.status::text AS instance_status, i.suspended_reason, i.process,
       i.process_version, i.input, i.traceparent, i.routes
  FROM successor_intents s JOIN instances i ON i.id = s.instance_id
 WHERE s.status = 'pending' AND (s.not_before IS NULL OR s.not_before <= now())
   AND (i.status <> 'suspended' OR i.suspended_reason = 'definition_missing')
 ORDER BY s.id
 LIMIT %(limit)s
   FOR UPDATE OF s, i SKIP LOCKED;

-- name: successor_defer
UPDATE successor_intents SET not_before = now() + make_interval(secs => %(delay)s)
 WHERE id = %(id)s AND status = 'pending';

-- name: instance_suspend_for
UPDATE instances SET status = 'suspended', suspended_reason = %(reason)s, updated_at = now()
 WHERE id = %(id)s AND status = 'running';

-- name: instance_resume_from
UPDATE instances SET status = 'running', suspended_reason = NULL, updated_at = now()
 WHERE id = %(id)s AND status = 'suspended' AND suspended_reason = %(reason)s;

-- name: instance_results
SELECT instance_id, node, result FROM operations
 WHERE instance_id = ANY(%(ids)s) AND status = 'succeeded'
 ORDER BY instance_id, node, activation;

-- name: node_activations
SELECT instance_id, node, max(activation) AS activation FROM node_states
 WHERE instance_id = ANY(%(ids)s)
 GROUP BY instance_id, node;

-- name: successor_done
UPDATE successor_intents SET status = 'done', done_at = now()
 WHERE id = ANY(%(ids)s) AND status = 'pending';

-- name: instance_finish
UPDATE instances SET status = %(status)s, finished_at = now(), updated_at = now()
 WHERE id = %(id)s AND status = 'running';

-- name: outbox_claim
-- Effect dispatch (submits) waits while dispatch is paused, globally or for the
-- instance; queries and cancels still flow (the restore runbook reconciles while paused).
-- A submit is dispatched only for its operation's current attempt, while that operation
-- is in flight and its instance running: a suspended instance's submit is held, a
-- settled or cancelling operation's is never sent (submits_retire retires it).
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
                                      JOIN instances i ON i.id = op.instance_id
                                      JOIN attempts a ON a.request_id = b.id
                                     WHERE op.id = b.operation_id AND NOT i.dispatch_paused
                                       AND i.status = 'running' AND a.attempt = op.attempt
                                       AND op.status IN ('pending', 'dispatched', 'accepted'))))
                 ORDER BY b.next_attempt_at
                 LIMIT %(limit)s
                   FOR UPDATE OF b SKIP LOCKED)
RETURNING o.id, o.kind, o.exchange, o.routing_key, o.body, o.headers, o.operation_id,
          o.publish_attempts;

-- name: p_outbox_claim
UPDATE outbox o
   SET claimed_by = %(holder)s,
       claim_expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
       publish_attempts = o.publish_attempts + 1
 WHERE o.id IN (SELECT id FROM outbox
                 WHERE status = 'pending' AND next_attempt_at <= now()
                   AND (claim_expires_at IS NULL OR claim_expires_at < clock_timestamp())
                 ORDER BY next_attempt_at
                 LIMIT %(limit)s
                   FOR UPDATE SKIP LOCKED)
RETURNING o.id, o.exchange, o.routing_key, o.body, o.headers, o.operation_id, o.publish_attempts;

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

-- name: outbox_stats
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age_s
  FROM outbox WHERE status = 'pending';

-- name: operations_dispatched
-- The confirm mark never moves an operation backward; the deadline clock starts here.
-- Only a submit's confirm dispatches (the caller passes the confirmed submits' request
-- ids, i.e. outbox ids, and their operation ids), and only the submit of the
-- operation's current attempt: a query's or a cancel's confirm is not progress, and a
-- late confirm of attempt n's submit does not dispatch attempt n+1, whose own submit
-- may not have been sent. By primary key on operations (the request ids only filter).
UPDATE operations o
   SET status = 'dispatched', updated_at = now(),
       deadline_at = coalesce(deadline_at, now() + make_interval(secs => deadline_seconds))
 WHERE o.id = ANY(%(ids)s) AND o.status = 'pending'
   AND EXISTS (SELECT 1 FROM attempts a
                WHERE a.request_id = ANY(%(requests)s::uuid[]) AND a.kind = 'submit'
                  AND a.operation_id = o.id AND a.attempt = o.attempt)
RETURNING o.id, o.instance_id;

-- name: operations_lock
SELECT o.id, o.tenant, o.instance_id, o.node, o.operation, o.route, o.owner, o.principal,
       o.binding, o.input, o.attempt, o.status, o.effect, o.owner_revision, o.receipt_hash,
       o.lineage, o.created_at, i.status::text AS instance_status
  FROM operations o JOIN instances i ON i.id = o.instance_id
 WHERE o.id = ANY(%(ids)s)
 ORDER BY o.id
   FOR UPDATE OF o;

-- name: revisions_seen
-- Every (operation, attempt, owner revision) already recorded, with its content.
SELECT operation_id::text, attempt, owner_revision, content_hash FROM receipt_inbox
 WHERE (operation_id, attempt, owner_revision) IN (
       SELECT * FROM unnest(%(operation_id)s::uuid[], %(attempt)s::int[],
                            %(owner_revision)s::int[]));

-- name: attempts_for
SELECT request_id::text, operation_id::text, attempt, kind, digest
  FROM attempts WHERE request_id = ANY(%(ids)s);

-- name: receipts_seen
SELECT receipt_id::text, content_hash FROM receipt_inbox WHERE receipt_id = ANY(%(ids)s);

-- name: receipt_record
INSERT INTO receipt_inbox (receipt_id, operation_id, attempt, owner_revision, status,
                           content_hash, decision)
VALUES (%(receipt_id)s, %(operation_id)s, %(attempt)s, %(owner_revision)s, %(status)s,
        %(content_hash)s, %(decision)s)
ON CONFLICT (receipt_id) DO NOTHING;

-- name: operation_apply
UPDATE operations
   SET status = %(status)s, effect = %(effect)s, owner_revision = %(owner_revision)s,
       receipt_hash = %(receipt_hash)s, result = coalesce(%(result)s, result),
       error = coalesce(%(error)s, error), updated_at = now(),
       deadline_at = coalesce(deadline_at, now() + make_interval(secs => deadline_seconds)),
       retry_at = now() + make_interval(secs => %(retry_in)s),
       finished_at = CASE WHEN %(terminal)s THEN now() END
 WHERE id = %(id)s AND status = %(expected)s;

-- name: node_finish
UPDATE node_states SET status = %(status)s, updated_at = now()
 WHERE operation_id = %(operation_id)s AND status = 'active';

-- name: successor_insert
INSERT INTO successor_intents (instance_id, from_operation_id, outcome, next_node)
VALUES (%(instance_id)s, %(from_operation_id)s, %(outcome)s, %(next_node)s)
ON CONFLICT (from_operation_id) DO NOTHING;

-- name: quarantine_insert
INSERT INTO quarantine (source, reason, detail, message_id, user_id, tenant, operation_id,
                        body, headers, worker)
VALUES (%(source)s, %(reason)s, %(detail)s, %(message_id)s, %(user_id)s, %(tenant)s,
        %(operation_id)s, %(body)s, %(headers)s, %(worker)s);

-- name: quarantine_list
SELECT id, source, reason, detail, message_id, user_id, tenant, operation_id, received_at
  FROM quarantine
 WHERE (%(reason)s::text IS NULL OR reason = %(reason)s)
 ORDER BY id DESC LIMIT %(limit)s;

-- name: operations_overdue
SELECT id, instance_id, status FROM operations
 WHERE status IN ('pending', 'dispatched', 'accepted') AND deadline_at < now()
 ORDER BY deadline_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: operation_set_status
UPDATE operations SET status = %(status)s, updated_at = now()
 WHERE id = %(id)s AND status = %(expected)s;

-- name: instance_unsuspend
-- Progress resumes once no operation of the instance is left without an outcome.
UPDATE instances SET status = 'running', suspended_reason = NULL, updated_at = now()
 WHERE id = %(id)s AND status = 'suspended'
   AND NOT EXISTS (SELECT 1 FROM operations
                    WHERE instance_id = %(id)s
                      AND status IN ('outcome_unknown', 'reconcile_pending'));

-- name: instance_suspend
UPDATE instances SET status = 'suspended', updated_at = now()
 WHERE id = %(id)s AND status = 'running';

-- name: operations_by_status
SELECT status::text, count(*) AS n FROM operations GROUP BY status;

-- name: instances_by_status
SELECT status::text, count(*) AS n FROM instances GROUP BY status;

-- name: instance_list
SELECT id, tenant, process, process_version, status, created_at, finished_at
  FROM instances
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
 ORDER BY created_at DESC LIMIT %(limit)s;

-- name: operation_list
SELECT id, tenant, instance_id, node, operation, route, binding, attempt, status, effect,
       owner_revision, created_at, finished_at
  FROM operations
 WHERE (%(status)s::text IS NULL OR status::text = %(status)s)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
   AND (%(route)s::text IS NULL OR route = %(route)s)
 ORDER BY created_at DESC LIMIT %(limit)s;

-- name: instance_history
SELECT id, operation_id, event, detail, actor, at FROM history
 WHERE instance_id = %(id)s ORDER BY id;

-- Participant runtime (search_path = the participant's schema) ----------------

-- name: p_tombstones_for
SELECT request_id::text FROM tombstones WHERE request_id = ANY(%(ids)s);

-- name: p_inbox_accept
INSERT INTO inbox (request_id, tenant, operation_id, attempt, operation, digest, command,
                   status, effect, owner_revision, traceparent)
SELECT * FROM unnest(%(request_id)s::uuid[], %(tenant)s::text[], %(operation_id)s::uuid[],
                     %(attempt)s::int[], %(operation)s::text[], %(digest)s::text[],
                     %(command)s::jsonb[], %(status)s::text[], %(effect)s::text[],
                     %(owner_revision)s::int[], %(traceparent)s::text[])
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id::text;

-- name: p_inbox_get
SELECT request_id::text, digest, status, owner_revision FROM inbox
 WHERE request_id = ANY(%(ids)s);

-- name: p_conflict_insert
INSERT INTO conflicts (request_id, stored_digest, received_digest, command)
VALUES (%(request_id)s, %(stored_digest)s, %(received_digest)s, %(command)s);

-- name: p_receipt_insert
INSERT INTO receipts (receipt_id, request_id, owner_revision, body)
VALUES (%(receipt_id)s, %(request_id)s, %(owner_revision)s, %(body)s)
ON CONFLICT (receipt_id) DO NOTHING;

-- name: p_reemit_latest
-- A repeated command gets the existing receipt again: the same id and bytes.
UPDATE outbox o
   SET status = 'pending', next_attempt_at = now(), claimed_by = NULL, claim_expires_at = NULL
  FROM (SELECT DISTINCT ON (request_id) receipt_id FROM receipts
         WHERE request_id = ANY(%(ids)s)
         ORDER BY request_id, owner_revision DESC) r
 WHERE o.id = r.receipt_id AND o.status = 'published';

-- name: p_refused_insert
INSERT INTO refused (reason, detail, message_id, body)
VALUES (%(reason)s, %(detail)s, %(message_id)s, %(body)s);

-- name: p_exec_claim
-- A short transaction: the executor marks a batch as its own (claim token, expiry) and
-- commits; no row lock outlives it. A row whose handler runs right now is locked by
-- that handler's transaction and skipped; a crashed executor's claims expire, and an
-- executor redoing its unit after a transient failure takes its own back at once.
UPDATE inbox i
   SET claimed_until = clock_timestamp() + make_interval(secs => %(ttl)s),
       claim_token = %(token)s
 WHERE i.request_id IN (SELECT request_id FROM inbox
                         WHERE status = 'accepted'
                           AND (claimed_until IS NULL OR claimed_until < clock_timestamp()
                                OR claim_token = %(token)s)
                         ORDER BY accepted_at
                         LIMIT %(limit)s
                           FOR UPDATE SKIP LOCKED)
RETURNING i.request_id::text, i.accepted_at;

-- name: p_exec_lock
-- One handler's transaction re-locks its row and re-checks it: still accepted (a
-- cancel may have settled it since the claim) and still claimed by this executor (an
-- expired claim may have been taken by another). No row: the handler does not run.
SELECT request_id::text, tenant, operation_id::text, attempt, operation, digest, command,
       owner_revision, executions, traceparent
  FROM inbox
 WHERE request_id = %(request_id)s AND status = 'accepted' AND claim_token = %(token)s
   FOR UPDATE;

-- name: p_exec_complete
UPDATE inbox
   SET status = %(status)s, effect = %(effect)s, owner_revision = %(owner_revision)s,
       result = %(result)s, error = %(error)s, completed_at = now(),
       claimed_until = NULL, claim_token = NULL
 WHERE request_id = %(request_id)s AND status = 'accepted';

-- name: p_exec_defer
-- The claim is dropped (no token) and the row waits out its backoff before any claim.
UPDATE inbox SET claimed_until = clock_timestamp() + make_interval(secs => %(delay)s),
                 claim_token = NULL, executions = executions + 1
 WHERE request_id = %(request_id)s AND status = 'accepted';

-- name: p_latest_receipts
SELECT DISTINCT ON (request_id) request_id::text, body FROM receipts
 WHERE request_id = ANY(%(ids)s)
 ORDER BY request_id, owner_revision DESC;

-- name: p_outbox_insert
INSERT INTO outbox (id, exchange, routing_key, body, headers, operation_id)
VALUES (%(id)s, %(exchange)s, %(routing_key)s, %(body)s, %(headers)s, %(operation_id)s)
ON CONFLICT (id) DO NOTHING;

-- name: p_answer_upsert
-- Every query is answered, a repeated one included (a restored engine re-issues query
-- ids): an answer row that exists is re-armed with the current answer. A row claimed
-- by a publisher right now loses its claim, so its mark fails and it is sent again: a
-- publication always starts after the query was retained.
INSERT INTO outbox (id, exchange, routing_key, body, headers, operation_id)
VALUES (%(id)s, %(exchange)s, %(routing_key)s, %(body)s, %(headers)s, %(operation_id)s)
ON CONFLICT (id) DO UPDATE
   SET body = excluded.body, headers = excluded.headers, status = 'pending',
       next_attempt_at = now(), claimed_by = NULL, claim_expires_at = NULL,
       published_at = NULL, last_error = NULL;

-- name: p_refused_list
SELECT id, reason, detail, message_id, received_at FROM refused
 WHERE (%(reason)s::text IS NULL OR reason = %(reason)s)
 ORDER BY id DESC LIMIT %(limit)s;

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

-- name: audit_list
SELECT id, at, actor, action, tenant, target, reason, outcome FROM audit
 ORDER BY id DESC LIMIT %(limit)s;

-- name: instance_get
SELECT id::text, tenant, process, process_version, status::text, dispatch_paused, input,
       created_at, finished_at
  FROM instances WHERE id = %(id)s;

-- name: instance_operations
SELECT id, node, activation, operation, route, binding, attempt, status::text, effect::text,
       owner_revision, result, error, deadline_at, retry_at
  FROM operations WHERE instance_id = %(id)s ORDER BY created_at;

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

-- name: successor_intents_pending
SELECT count(*) AS n FROM successor_intents WHERE status = 'pending';

-- name: queries_overdue
SELECT id, instance_id, status::text FROM operations
 WHERE status = 'reconcile_pending' AND deadline_at < now()
 ORDER BY deadline_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- Cancellation ---------------------------------------------------------------------

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

-- name: instance_set_cancelling
UPDATE instances SET status = 'cancelling', updated_at = now()
 WHERE id = %(id)s AND status IN ('running', 'suspended');

-- name: instance_settle_cancel
-- A cancelling instance is cancelled once every operation has authoritative evidence.
UPDATE instances SET status = 'cancelled', finished_at = now(), updated_at = now()
 WHERE id = %(id)s AND status = 'cancelling'
   AND NOT EXISTS (SELECT 1 FROM operations
                    WHERE instance_id = %(id)s
                      AND status NOT IN ('succeeded', 'failed', 'cancelled'));

-- name: p_inbox_lock
-- Acceptance never waits behind execution: a row locked by a running handler (or a
-- concurrent short transaction) is skipped; p_inbox_peek then tells which.
SELECT request_id::text, tenant, operation_id::text, attempt, operation, digest, status,
       owner_revision, command
  FROM inbox WHERE request_id = %(id)s
   FOR UPDATE SKIP LOCKED;

-- name: p_inbox_peek
-- Without a lock: does the row exist, and does an executor hold an unexpired claim.
SELECT request_id::text, coalesce(claimed_until > clock_timestamp(), false) AS claimed
  FROM inbox WHERE request_id = %(id)s;

-- name: p_tombstone_insert
INSERT INTO tombstones (request_id, tenant, operation_id, reason)
VALUES (%(request_id)s, %(tenant)s, %(operation_id)s, %(reason)s)
ON CONFLICT DO NOTHING;

-- name: p_inbox_tombstoned
-- A cancel that arrived before its command takes the command's identity: the late
-- command finds it, and is refused instead of executed.
INSERT INTO inbox (request_id, tenant, operation_id, attempt, operation, digest, command,
                   status, effect, owner_revision, completed_at)
VALUES (%(request_id)s, %(tenant)s, %(operation_id)s, %(attempt)s, %(operation)s, %(digest)s,
        %(command)s, 'cancelled', 'none', 1, now())
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id::text;

-- name: p_inbox_cancel
UPDATE inbox SET status = 'cancelled', effect = 'none', owner_revision = %(owner_revision)s,
                 completed_at = now()
 WHERE request_id = %(request_id)s AND status = 'accepted';

-- Restore runbook and retention ---------------------------------------------------

-- name: attempts_known
SELECT request_id::text FROM attempts WHERE request_id = ANY(%(ids)s);

-- name: p_journal
SELECT request_id::text, tenant, command->'lineage'->>'instance_id' AS instance_id,
       operation_id::text, attempt, operation, status, effect, owner_revision, accepted_at,
       completed_at
  FROM inbox ORDER BY accepted_at;

-- name: retention_receipts
DELETE FROM receipt_inbox r
 WHERE r.ctid IN (SELECT r2.ctid FROM receipt_inbox r2 JOIN operations o ON o.id = r2.operation_id
                   WHERE r2.received_at < now() - make_interval(secs => %(horizon)s)
                     AND o.status IN ('succeeded', 'failed', 'cancelled')
                   LIMIT %(limit)s);

-- name: retention_outbox
-- Sent rows after the horizon, and retired ones (never sent) once as old.
DELETE FROM outbox WHERE ctid IN (
  SELECT ctid FROM outbox
   WHERE (status = 'published' AND published_at < now() - make_interval(secs => %(horizon)s))
      OR (status = 'retired' AND created_at < now() - make_interval(secs => %(horizon)s))
   LIMIT %(limit)s);

-- name: retention_quarantine
DELETE FROM quarantine WHERE ctid IN (
  SELECT ctid FROM quarantine WHERE received_at < now() - make_interval(secs => %(horizon)s)
   LIMIT %(limit)s);

-- name: p_retention_inbox
-- A settled command's identity, its receipts and its tombstone are forgotten only
-- after the horizon: until then a replay is deduplicated, never executed again.
WITH old AS (
  SELECT request_id FROM inbox
   WHERE status <> 'accepted' AND completed_at < now() - make_interval(secs => %(horizon)s)
   LIMIT %(limit)s
), r AS (DELETE FROM receipts WHERE request_id IN (SELECT request_id FROM old)),
   t AS (DELETE FROM tombstones WHERE request_id IN (SELECT request_id FROM old))
DELETE FROM inbox WHERE request_id IN (SELECT request_id FROM old);

-- name: p_retention_outbox
DELETE FROM outbox WHERE ctid IN (
  SELECT ctid FROM outbox WHERE status = 'published'
     AND published_at < now() - make_interval(secs => %(horizon)s) LIMIT %(limit)s);

-- Controlled commands (transitions.sql) -------------------------------------------------
-- op_*: an operator's login; the database takes the actor from session_user.
-- t_*: a worker's policy or engine-channel request, with its own actor.

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

-- name: operators_sync
-- deploy/operators.toml into the database (custody migrate, custody operators apply)
INSERT INTO custody.operators (name, actions, tenants, updated_at)
VALUES (%(name)s, %(actions)s, %(tenants)s, now())
ON CONFLICT (name) DO UPDATE
   SET actions = EXCLUDED.actions, tenants = EXCLUDED.tenants, updated_at = now();

-- name: operators_prune
DELETE FROM custody.operators WHERE NOT (name = ANY(%(names)s));

-- Harness reads (the demo, the bench: workers.harness.env) ------------------------------

-- name: harness_outbox_pending
SELECT count(*) AS n FROM outbox WHERE status = 'pending';

-- name: harness_quarantined
SELECT count(*) AS n FROM quarantine;

-- name: harness_succeeded_by_operation
SELECT operation, count(*) AS n FROM operations WHERE status = 'succeeded' GROUP BY 1;
