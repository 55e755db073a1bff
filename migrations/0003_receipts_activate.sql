-- The receipt consumer activates the successor of a receipt it applies (issue 14), in
-- the receipt's own transaction, where it locked the instance without waiting and
-- found it running: the result, the successor intent (written done) and the
-- transition (node state, history, operation, attempt, dispatch intent) commit
-- together, and the submit leaves from the receipt consumer's own sender right after
-- the commit, as the committer's does. Every other intent is written pending, for the
-- committer's claim.

-- A successor intent wakes the committer only when one was written pending.
CREATE OR REPLACE FUNCTION custody.notify_successor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM inserted WHERE status = 'pending') THEN
    PERFORM pg_notify('custody_successor', '');
  END IF;
  RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS successor_notify ON custody.successor_intents;
CREATE TRIGGER successor_notify AFTER INSERT ON custody.successor_intents
  REFERENCING NEW TABLE AS inserted
  FOR EACH STATEMENT EXECUTE FUNCTION custody.notify_successor();

-- A transition's rows, as the committer writes them (activation_insert, instance_finish:
-- its UPDATE of instances it has already), never a start (no instance, no tombstone).
GRANT INSERT ON custody.node_states, custody.operations, custody.attempts, custody.outbox
  TO custody_receipts;
-- ... and only a new activation's rows (row-level security is on for these tables,
-- transitions.sql; a restrictive policy holds whatever the permissive ones allow): the
-- role that reads what participants send never inserts an outcome, a query, a cancel,
-- a command for another exchange, or the record of a request it did not submit.
DROP POLICY IF EXISTS receipts_activate ON custody.node_states;
CREATE POLICY receipts_activate ON custody.node_states AS RESTRICTIVE FOR INSERT
  TO custody_receipts WITH CHECK (status = 'active');
DROP POLICY IF EXISTS receipts_activate ON custody.operations;
CREATE POLICY receipts_activate ON custody.operations AS RESTRICTIVE FOR INSERT
  TO custody_receipts
  WITH CHECK (status = 'pending' AND effect = 'unknown' AND attempt = 1 AND result IS NULL
              AND error IS NULL);
DROP POLICY IF EXISTS receipts_activate ON custody.attempts;
CREATE POLICY receipts_activate ON custody.attempts AS RESTRICTIVE FOR INSERT
  TO custody_receipts WITH CHECK (kind = 'submit' AND attempt = 1);
DROP POLICY IF EXISTS receipts_activate ON custody.outbox;
CREATE POLICY receipts_activate ON custody.outbox AS RESTRICTIVE FOR INSERT
  TO custody_receipts
  WITH CHECK (kind = 'submit' AND status = 'pending' AND exchange = 'custody.commands');

-- Its sender marks what it sent as the committer's does (outbox_mark_dispatched,
-- outbox_release, outbox_unclaim): the columns those read and write, never a command's
-- body; its confirm mark moves an operation pending -> dispatched (the operations'
-- status, updated_at and deadline_at it may update already).
GRANT SELECT (id, kind, operation_id, status, claimed_by, publish_attempts)
  ON custody.outbox TO custody_receipts;
GRANT UPDATE (status, claimed_by, claim_expires_at, next_attempt_at, last_error, published_at)
  ON custody.outbox TO custody_receipts;

-- Only a broker confirm dispatches: the publisher's mark, or the committer's or the
-- receipt consumer's sender's. The committer moves an operation to nothing else.
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
     AND NOT pg_has_role(current_user, 'custody_committer', 'MEMBER')
     AND NOT pg_has_role(current_user, 'custody_receipts', 'MEMBER')
  THEN
    RAISE EXCEPTION 'only a broker confirm dispatches (operation %, attempted by %)',
      OLD.id, current_user USING ERRCODE = 'CU003';
  END IF;
  IF NEW.status <> 'dispatched' AND pg_has_role(current_user, 'custody_committer', 'MEMBER')
     AND NOT pg_has_role(current_user, 'custody_publisher', 'MEMBER')
     AND NOT pg_has_role(current_user, 'custody_receipts', 'MEMBER')
  THEN
    RAISE EXCEPTION 'the committer only dispatches (operation % -> %, attempted by %)',
      OLD.id, NEW.status, current_user USING ERRCODE = 'CU003';
  END IF;
  RETURN NEW;
END $$;
