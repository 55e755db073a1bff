"""The one closed list of quarantine and refusal reasons. Pure.

Every quarantine row (engine), refused row (participant) and the
``custody_quarantined_total`` metric label carries one of these codes: the codec's
(``contracts.codec.DecodeError.reason``, checked against this list by the unit tests:
contracts imports nothing from workers), the broker's, a receipt's or query answer's
validation (:mod:`workers.core.validation`), a start request's
(:mod:`workers.core.activation`) and a participant's (:mod:`workers.core.acceptance`).
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # the codec (schema happens there) and the broker's delivery properties
    OVERSIZED = "oversized"
    NOT_UTF8 = "not_utf8"
    MALFORMED_JSON = "malformed_json"
    SCHEMA = "schema"
    UNKNOWN_TYPE = "unknown_type"
    NON_CANONICAL_VALUE = "non_canonical_value"
    UNDECODABLE_PROPERTIES = "undecodable_properties"
    MALFORMED_ENVELOPE = "malformed_envelope"
    # receipts and query answers, in the order validation checks them
    WRONG_TENANT = "wrong_tenant"
    MISSING_USER_ID = "missing_user_id"
    PRINCIPAL_MISMATCH = "principal_mismatch"
    WRONG_OWNER = "wrong_owner"
    RECEIPT_ID_MISMATCH = "receipt_id_mismatch"
    RECEIPT_ID_REUSE = "receipt_id_reuse"
    UNKNOWN_OPERATION = "unknown_operation"
    UNKNOWN_REQUEST = "unknown_request"
    DIGEST_MISMATCH = "digest_mismatch"
    INCONSISTENT_EFFECT = "inconsistent_effect"
    REVISION_CONFLICT = "revision_conflict"
    ILLEGAL_TRANSITION = "illegal_transition"
    RESTORE_GENERATION = "restore_generation"
    # what follows a valid receipt cannot be decided: its process version is not loaded
    DEFINITION_MISSING = "definition_missing"
    # start requests
    START_CONFLICT = "start_conflict"
    UNKNOWN_PROCESS = "unknown_process"
    BAD_START_INPUT = "bad_start_input"
    ACTIVATION_FAILED = "activation_failed"
    # a participant's refusals (beside wrong_owner, digest_mismatch and the codec's)
    TOMBSTONED = "tombstoned"
    DIGEST_CONFLICT = "digest_conflict"


REASONS: tuple[Reason, ...] = tuple(Reason)
