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
SELECT s.id, s.instance_id, s.from_operation_id, s.outcome, s.next_node,
       i.tenant, i.status::text AS instance_status, i.process, i.process_version, i.input,
       i.traceparent, i.routes
  FROM successor_intents s JOIN instances i ON i.id = s.instance_id
 WHERE s.status = 'pending' AND i.status <> 'suspended'
 ORDER BY s.id
 LIMIT %(limit)s
   FOR UPDATE OF s SKIP LOCKED;

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
UPDATE outbox o
   SET claimed_by = %(holder)s,
       claim_expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
       publish_attempts = o.publish_attempts + 1
 WHERE o.id IN (SELECT b.id FROM outbox b
                 WHERE b.status = 'pending' AND b.next_attempt_at <= now()
                   AND (b.claim_expires_at IS NULL OR b.claim_expires_at < clock_timestamp())
                   AND (b.kind <> 'submit' OR (
                        NOT %(held)s AND NOT (SELECT dispatch_paused FROM control)
                        AND NOT EXISTS (SELECT 1 FROM operations op
                                          JOIN instances i ON i.id = op.instance_id
                                         WHERE op.id = b.operation_id AND i.dispatch_paused)))
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
-- Only a submit's confirm dispatches (the caller passes submits' operation ids): a
-- query's or a cancel's confirm is not progress. By primary key, never a join.
UPDATE operations
   SET status = 'dispatched', updated_at = now(),
       deadline_at = coalesce(deadline_at, now() + make_interval(secs => deadline_seconds))
 WHERE id = ANY(%(ids)s) AND status = 'pending'
RETURNING id, instance_id;

-- name: operations_lock
SELECT id, tenant, instance_id, node, operation, route, owner, principal, binding, input,
       attempt, status, effect, owner_revision, receipt_hash, lineage, created_at
  FROM operations WHERE id = ANY(%(ids)s)
 ORDER BY id
   FOR UPDATE;

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
UPDATE instances SET status = 'running', updated_at = now()
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
SELECT request_id::text, tenant, operation_id::text, attempt, operation, digest, command,
       owner_revision, executions, traceparent
  FROM inbox
 WHERE status = 'accepted' AND (claimed_until IS NULL OR claimed_until < now())
 ORDER BY accepted_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: p_exec_complete
UPDATE inbox
   SET status = %(status)s, effect = %(effect)s, owner_revision = %(owner_revision)s,
       result = %(result)s, error = %(error)s, completed_at = now()
 WHERE request_id = %(request_id)s AND status = 'accepted';

-- name: p_exec_defer
UPDATE inbox SET claimed_until = now() + make_interval(secs => %(delay)s),
                 executions = executions + 1
 WHERE request_id = %(request_id)s AND status = 'accepted';

-- name: p_latest_receipts
SELECT DISTINCT ON (request_id) request_id::text, body FROM receipts
 WHERE request_id = ANY(%(ids)s)
 ORDER BY request_id, owner_revision DESC;

-- name: p_outbox_insert
INSERT INTO outbox (id, exchange, routing_key, body, headers, operation_id)
VALUES (%(id)s, %(exchange)s, %(routing_key)s, %(body)s, %(headers)s, %(operation_id)s)
ON CONFLICT (id) DO NOTHING;

-- name: p_refused_list
SELECT id, reason, detail, message_id, received_at FROM refused
 WHERE (%(reason)s::text IS NULL OR reason = %(reason)s)
 ORDER BY id DESC LIMIT %(limit)s;

-- name: operation_for_update
SELECT id, tenant, instance_id, node, operation, route, owner, principal, binding, input,
       lineage, attempt, digest, status::text, effect::text, deadline_seconds
  FROM operations WHERE id = %(id)s
   FOR UPDATE;

-- name: queries_issued
SELECT count(*) AS n FROM attempts
 WHERE operation_id = %(id)s AND attempt = %(attempt)s AND kind = %(kind)s;

-- name: operation_reconcile
UPDATE operations
   SET status = 'reconcile_pending', updated_at = now(),
       deadline_at = now() + make_interval(secs => deadline_seconds)
 WHERE id = %(id)s AND status = %(expected)s;

-- name: operation_new_attempt
-- The only way to a new attempt: same operation id and input, attempt n+1, a new
-- command identity, and nothing known yet about it.
UPDATE operations
   SET attempt = %(attempt)s, digest = %(digest)s, status = 'pending', effect = 'unknown',
       owner_revision = 0, receipt_hash = NULL, result = NULL, error = NULL,
       deadline_at = NULL, retry_at = NULL, updated_at = now()
 WHERE id = %(id)s AND status = 'retry_waiting' AND effect = 'none'
   AND attempt = %(attempt)s - 1;

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

-- name: audit_insert
INSERT INTO audit (actor, action, tenant, target, reason, inputs, outcome)
VALUES (%(actor)s, %(action)s, %(tenant)s, %(target)s, %(reason)s, %(inputs)s, %(outcome)s);

-- name: audit_list
SELECT id, at, actor, action, tenant, target, reason, outcome FROM audit
 ORDER BY id DESC LIMIT %(limit)s;

-- name: control_set_paused
UPDATE control SET dispatch_paused = %(paused)s, updated_at = now();

-- name: instance_get
SELECT id::text, tenant, process, process_version, status::text, dispatch_paused, input,
       created_at, finished_at
  FROM instances WHERE id = %(id)s;

-- name: instance_set_paused
UPDATE instances SET dispatch_paused = %(paused)s, updated_at = now() WHERE id = %(id)s;

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
-- Serialises a start request with its cancellation: exactly one of the two wins.
SELECT pg_advisory_xact_lock(k)
  FROM (SELECT DISTINCT hashtext(t || '/' || s) AS k
          FROM unnest(%(tenant)s::text[], %(start_request_id)s::text[]) AS u(t, s)
         ORDER BY 1) AS keys;

-- name: start_tombstones_for
SELECT tenant, start_request_id::text FROM start_tombstones
 WHERE (tenant, start_request_id) IN (
       SELECT * FROM unnest(%(tenant)s::text[], %(start_request_id)s::uuid[]));

-- name: start_tombstone_late
UPDATE start_tombstones SET late_start_at = coalesce(late_start_at, now())
 WHERE tenant = %(tenant)s AND start_request_id = %(start_request_id)s;

-- name: start_tombstone_insert
INSERT INTO start_tombstones (tenant, start_request_id, actor, reason)
VALUES (%(tenant)s, %(start_request_id)s, %(actor)s, %(reason)s)
ON CONFLICT DO NOTHING;

-- name: instance_by_start
SELECT id::text FROM instances WHERE tenant = %(tenant)s AND start_request_id = %(start_request_id)s;

-- name: instance_for_update
SELECT id::text, tenant, status::text FROM instances WHERE id = %(id)s FOR UPDATE;

-- name: instance_set_cancelling
UPDATE instances SET status = 'cancelling', updated_at = now()
 WHERE id = %(id)s AND status IN ('running', 'suspended');

-- name: instance_unresolved
SELECT id, tenant, instance_id, node, operation, route, owner, principal, binding, input,
       lineage, attempt, digest, status::text, effect::text, deadline_seconds
  FROM operations
 WHERE instance_id = %(id)s AND status NOT IN ('succeeded', 'failed', 'cancelled')
 ORDER BY id
   FOR UPDATE;

-- name: operation_cancel
UPDATE operations
   SET status = %(status)s::custody.operation_status, updated_at = now(),
       effect = CASE WHEN %(status)s::text = 'cancelled' THEN 'none'::custody.effect ELSE effect END,
       finished_at = CASE WHEN %(status)s::text = 'cancelled' THEN now() END
 WHERE id = %(id)s AND status = %(expected)s;

-- name: instance_settle_cancel
-- A cancelling instance is cancelled once every operation has authoritative evidence.
UPDATE instances SET status = 'cancelled', finished_at = now(), updated_at = now()
 WHERE id = %(id)s AND status = 'cancelling'
   AND NOT EXISTS (SELECT 1 FROM operations
                    WHERE instance_id = %(id)s
                      AND status NOT IN ('succeeded', 'failed', 'cancelled'));

-- name: p_inbox_lock
SELECT request_id::text, tenant, operation_id::text, attempt, operation, digest, status,
       owner_revision, command
  FROM inbox WHERE request_id = %(id)s
   FOR UPDATE;

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

-- name: control_mark_restored
UPDATE control SET dispatch_paused = true, restore_generation = restore_generation + 1,
                   updated_at = now()
RETURNING restore_generation;

-- name: restore_candidates
-- Every operation of the restored state that is not settled and not already asked.
SELECT id, tenant, instance_id, node, operation, route, owner, principal, binding, input,
       lineage, attempt, digest, status::text, effect::text, deadline_seconds
  FROM operations
 WHERE status IN ('pending', 'dispatched', 'accepted', 'outcome_unknown', 'reconcile_pending')
   AND NOT (id = ANY(%(done)s))
 ORDER BY id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: operations_count_by_status
SELECT count(*) AS n FROM operations WHERE status::text = ANY(%(statuses)s);

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
DELETE FROM outbox WHERE ctid IN (
  SELECT ctid FROM outbox WHERE status = 'published'
     AND published_at < now() - make_interval(secs => %(horizon)s) LIMIT %(limit)s);

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
