-- The committer publishes the submits it commits itself (issue 14): activation_insert
-- queues them already claimed by its own sender, which sends them right after the
-- commit, with no NOTIFY, no wake-up and no claim transaction on the way; the publisher
-- claims the rest (reconciler's and operators' commands, a submit held by a dispatch
-- pause, a claim whose sender died before its mark, once the claim expired).

-- The outbox's NOTIFY wakes the publisher only for rows it must claim: a statement that
-- inserted none (or only rows claimed at insert) wakes nobody.
CREATE OR REPLACE FUNCTION custody.notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM inserted WHERE claimed_by IS NULL) THEN
    PERFORM pg_notify('custody_outbox', '');
  END IF;
  RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS outbox_notify ON custody.outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON custody.outbox REFERENCING NEW TABLE AS inserted
  FOR EACH STATEMENT EXECUTE FUNCTION custody.notify_outbox();

-- The committer is never a member of custody_publisher (it would get every right of the
-- publisher's: retiring, claiming, any status change a confirm mark does not make): its
-- sender gets the column grants below, and the guard lets it dispatch and nothing else.
-- Roles are the cluster's, so this holds whatever granted the membership before.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_auth_members m
              WHERE m.roleid = 'custody_publisher'::regrole
                AND m.member = 'custody_committer'::regrole) THEN
    REVOKE custody_publisher FROM custody_committer;
  END IF;
END $$;

-- The committer's sender marks what it sent as the publisher does (outbox_mark_dispatched,
-- outbox_release, outbox_unclaim): the columns those read and write, never a command's
-- body; its confirm mark moves an operation pending -> dispatched.
GRANT SELECT (id, kind, operation_id, status, claimed_by, publish_attempts)
  ON custody.outbox TO custody_committer;
GRANT UPDATE (status, claimed_by, claim_expires_at, next_attempt_at, last_error, published_at)
  ON custody.outbox TO custody_committer;
GRANT UPDATE (status, updated_at, deadline_at) ON custody.operations TO custody_committer;

-- Only a broker confirm dispatches: the publisher's mark, or the committer's sender's. The
-- committer moves an operation to nothing else (a cancel, a deadline, a receipt are other
-- boundaries'; its operator calls run as their functions' owners).
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
