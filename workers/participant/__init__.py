"""The library a participant service embeds: acceptance, execution, receipts."""

from workers.participant.service import BusinessFailure, Call, Handler, Participant

__all__ = ["BusinessFailure", "Call", "Handler", "Participant"]
