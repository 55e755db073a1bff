-- Participant queries (search_path = the participant's schema, participant_schema.sql),
-- loaded by workers/io/sql.py together with queries.sql; a name is unique across the two
-- files. Each group below is a commit boundary of workers/participant. The publisher's
-- mark, release and stats are queries.sql's outbox_* (the two outbox tables have one
-- shape).

-- Acceptor: a batch of deliveries (commands, cancels, queries) in one transaction ---------

-- name: p_inbox_accept
-- A batch's new submits offered to the inbox, and the tombstones of all its submit ids
-- (%(ids)s), in one statement (one round trip): a tombstoned identity is answered as
-- such and never inserted; an identity this statement inserted is answered as
-- inserted; one it did not is held already (ON CONFLICT waits for a concurrent inserter
-- to commit). The tombstones are read with the insert's snapshot, never an older one.
WITH t AS (
  SELECT request_id FROM tombstones WHERE request_id = ANY(%(ids)s)
), ins AS (
  INSERT INTO inbox (request_id, tenant, operation_id, attempt, operation, digest, command,
                     status, effect, owner_revision, traceparent)
  SELECT r.request_id, r.tenant, r.operation_id, r.attempt, r.operation, r.digest, r.command,
         r.status, r.effect, r.owner_revision, r.traceparent
    FROM jsonb_to_recordset(%(rows)s)
         AS r(request_id uuid, tenant text, operation_id uuid, attempt int, operation text,
              digest text, command jsonb, status text, effect text, owner_revision int,
              traceparent text)
   WHERE NOT EXISTS (SELECT 1 FROM t WHERE t.request_id = r.request_id)
  ON CONFLICT (request_id) DO NOTHING
  RETURNING request_id
)
SELECT request_id::text, true AS inserted FROM ins
UNION ALL
SELECT request_id::text, false FROM t;

-- name: p_inbox_get
SELECT request_id::text, digest, status, owner_revision FROM inbox
 WHERE request_id = ANY(%(ids)s);

-- name: p_reemit_latest
-- A repeated command gets the existing receipt again: the same id and bytes.
UPDATE outbox o
   SET status = 'pending', next_attempt_at = now(), claimed_by = NULL, claim_expires_at = NULL
  FROM (SELECT DISTINCT ON (request_id) receipt_id FROM receipts
         WHERE request_id = ANY(%(ids)s)
         ORDER BY request_id, owner_revision DESC) r
 WHERE o.id = r.receipt_id AND o.status = 'published';

-- name: p_conflict_insert
INSERT INTO conflicts (request_id, stored_digest, received_digest, command)
VALUES (%(request_id)s, %(stored_digest)s, %(received_digest)s, %(command)s);

-- name: p_refused_insert
INSERT INTO refused (reason, detail, message_id, body)
VALUES (%(reason)s, %(detail)s, %(message_id)s, %(body)s);

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

-- name: p_latest_receipts
SELECT DISTINCT ON (request_id) request_id::text, body FROM receipts
 WHERE request_id = ANY(%(ids)s)
 ORDER BY request_id, owner_revision DESC;

-- Receipts and answers: written inside the accepting or executing transaction -------------

-- name: p_receipt_insert
INSERT INTO receipts (receipt_id, request_id, owner_revision, body)
SELECT r.receipt_id, r.request_id, r.owner_revision, decode(r.body, 'base64')
  FROM jsonb_to_recordset(%(rows)s)
       AS r(receipt_id uuid, request_id uuid, owner_revision integer, body text)
ON CONFLICT (receipt_id) DO NOTHING;

-- name: p_outbox_insert
-- Receipts to send, claimed at once by %(holder)s when given: the participant's own
-- publisher, which sends them right after this commit from what it holds in memory (no
-- claim transaction, no wake-up). If it dies first, the claim expires and any publisher
-- claims them (p_outbox_claim). Returns the rows this statement inserted (a repeated id
-- is the row already queued, not ours to send).
INSERT INTO outbox (id, exchange, routing_key, body, headers, operation_id, claimed_by,
                    claim_expires_at, publish_attempts)
SELECT r.id, r.exchange, r.routing_key, decode(r.body, 'base64'), coalesce(r.headers, '{}'),
       r.operation_id, %(holder)s::text,
       CASE WHEN %(holder)s::text IS NOT NULL
            THEN clock_timestamp() + make_interval(secs => %(ttl)s::float8) END,
       CASE WHEN %(holder)s::text IS NOT NULL THEN 1 ELSE 0 END
  FROM ROWS FROM (jsonb_to_recordset(%(rows)s)
                  AS (id uuid, exchange text, routing_key text, body text, headers jsonb,
                      operation_id uuid))
       WITH ORDINALITY AS r(id, exchange, routing_key, body, headers, operation_id, n)
 ORDER BY r.n
ON CONFLICT (id) DO NOTHING
RETURNING id::text;

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

-- Executor: a short claim transaction, then one transaction per handler -------------------

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

-- name: p_exec_defer
-- The claim is dropped (no token) and the row waits out its backoff before any claim.
UPDATE inbox SET claimed_until = clock_timestamp() + make_interval(secs => %(delay)s),
                 claim_token = NULL, executions = executions + 1
 WHERE request_id = %(request_id)s AND status = 'accepted';

-- name: p_exec_complete
-- The batch's completed commands, from their terminal receipts, in one statement. Each
-- row is locked by this transaction and still accepted (inserted by it, or re-checked
-- under its lock by the executor): a row count below the batch's is a row changed under
-- its lock, raised here (CU004, the unit is redone), so that the unit sends it with its
-- COMMIT instead of waiting for the count.
WITH completed AS (
UPDATE inbox i
   SET status = r.status, effect = r.effect, owner_revision = r.owner_revision,
       result = r.result, error = r.error, completed_at = now(),
       claimed_until = NULL, claim_token = NULL
  FROM jsonb_to_recordset(%(rows)s)
       AS r(request_id uuid, status text, effect text, owner_revision integer, result jsonb,
            error jsonb)
 WHERE i.request_id = r.request_id AND i.status = 'accepted'
RETURNING i.request_id)
SELECT changed_under_lock('an inbox row of the batch')
 WHERE (SELECT count(*) FROM completed) <> jsonb_array_length(%(rows)s);

-- name: p_outbox_supersede
-- A receipt still waiting to be sent when a newer receipt of the same command commits
-- (an ``accepted`` overtaken by the terminal one) is not sent: the newer one says
-- everything it says. The journal (receipts) keeps it. A row a publisher holds right
-- now (an unexpired claim) is left alone; a claim in progress holds the row's lock,
-- and this statement, waiting for it, then sees the claim and skips the row.
UPDATE outbox
   SET status = 'published', published_at = now(),
       last_error = 'superseded by receipt ' || %(by)s
 WHERE id = %(id)s AND status = 'pending'
   AND (claim_expires_at IS NULL OR claim_expires_at < clock_timestamp());

-- Publisher: claim a batch in one transaction (mark and release: queries.sql's outbox_*) ---

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

-- Retention (the participant, custody retention): bounded deletes, one transaction each ---

-- name: p_retention_inbox
-- A settled command's identity, its receipts and its tombstone are forgotten only
-- after the horizon: until then a replay is deduplicated, never executed again.
WITH old AS (
  SELECT request_id FROM inbox
   WHERE status <> 'accepted' AND completed_at < now() - make_interval(secs => %(horizon)s)
   ORDER BY completed_at
   LIMIT %(limit)s
), r AS (DELETE FROM receipts WHERE request_id = ANY(ARRAY(SELECT request_id FROM old))),
   t AS (DELETE FROM tombstones WHERE request_id = ANY(ARRAY(SELECT request_id FROM old)))
-- (= ANY(ARRAY(...)): by key; an IN (...) of the batch may be planned as a hash join that
-- reads the whole journal)
DELETE FROM inbox WHERE request_id = ANY(ARRAY(SELECT request_id FROM old));

-- Operator reads: custody quarantine (refused) and custody restore report (journal) -------

-- name: p_refused_list
SELECT id, reason, detail, message_id, received_at FROM refused
 WHERE (%(reason)s::text IS NULL OR reason = %(reason)s)
 ORDER BY id DESC LIMIT %(limit)s;

-- name: p_refused_stats
-- a participant's refused commands by reason (they carry no tenant: NULL)
SELECT CASE WHEN 'reason' = ANY(%(by)s) THEN reason END AS reason, NULL::text AS tenant,
       count(*) AS n, max(received_at) AS last_at
  FROM refused GROUP BY 1 ORDER BY n DESC, 1;

-- name: p_journal
SELECT request_id::text, tenant, command->'lineage'->>'instance_id' AS instance_id,
       operation_id::text, attempt, operation, status, effect, owner_revision, accepted_at,
       completed_at
  FROM inbox ORDER BY accepted_at;
