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

-- The committer's sender holds the broker-confirmation boundary for what it sends, as
-- the publisher does: the committer's role is a member of custody_publisher (the confirm
-- mark, outbox_mark_dispatched, moves an operation pending -> dispatched, which the
-- operation status guard allows only to that role). It still cannot write a command's
-- body, an outcome, or any column neither boundary owns.
GRANT custody_publisher TO custody_committer;
