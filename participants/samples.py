"""Handlers of the sample participants. Each effect is a row in the participant's own
database, written in the transaction that also commits the terminal receipt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from workers.participant import BusinessFailure, Call, Handler

CHARGE_LIMIT_CENTS: Final = 100_000


async def reserve(call: Call) -> Mapping[str, Any]:
    sku, quantity = call.input["sku"], call.input["quantity"]
    # a read (locked until the commit), so that refusing writes nothing: the runtime
    # then has nothing to undo (Tx.read); the writes leave without waiting
    rows = await call.tx.read("SELECT available FROM stock WHERE sku = %s FOR UPDATE", (sku,))
    if not rows or rows[0]["available"] < quantity:
        raise BusinessFailure("out_of_stock", f"not enough {sku} for {quantity}")
    await call.tx.business(
        "UPDATE stock SET available = available - %s WHERE sku = %s", (quantity, sku)
    )
    await call.tx.business(
        "INSERT INTO reservations (operation_id, order_id, sku, quantity) VALUES (%s, %s, %s, %s)",
        (call.operation_id, call.input["order_id"], sku, quantity),
    )
    return {"reservation_id": call.operation_id, "sku": sku, "quantity": quantity}


async def release(call: Call) -> Mapping[str, Any]:
    sku, quantity = call.input["sku"], call.input["quantity"]
    await call.tx.business(
        "UPDATE stock SET available = available + %s WHERE sku = %s", (quantity, sku)
    )
    await call.tx.business(
        "INSERT INTO releases (operation_id, order_id, sku, quantity) VALUES (%s, %s, %s, %s)",
        (call.operation_id, call.input["order_id"], sku, quantity),
    )
    return {"released": quantity}


async def charge(call: Call) -> Mapping[str, Any]:
    amount = call.input["amount_cents"]
    if call.input.get("flaky") and call.attempt == 1:
        # a transient gateway failure, decided before any effect: effect none
        raise BusinessFailure("gateway_unavailable", "the card gateway did not answer")
    if amount > CHARGE_LIMIT_CENTS:
        raise BusinessFailure("declined", f"{amount} cents is over the card limit")
    await call.tx.business(
        "INSERT INTO charges (operation_id, order_id, amount_cents) VALUES (%s, %s, %s)",
        (call.operation_id, call.input["order_id"], amount),
    )
    return {"charge_id": call.operation_id, "amount_cents": amount}


async def ship(call: Call) -> Mapping[str, Any]:
    await call.tx.business(
        "INSERT INTO shipments (operation_id, order_id, address) VALUES (%s, %s, %s)",
        (call.operation_id, call.input["order_id"], call.input["address"]),
    )
    return {"tracking": "TRK-" + call.operation_id[:8].upper()}


HANDLERS: Final[Mapping[str, Mapping[str, Handler]]] = {
    "inventory": {"inventory.reserve": reserve, "inventory.release": release},
    "payments": {"payments.charge": charge},
    "shipping": {"shipping.ship": ship},
}

# Every sample handler is a few statements on its own tables: fast enough to run in
# the acceptance transaction (``service.serve(inline=...)``; the setting
# ``participant_inline`` turns it off, and the executor runs them instead).
INLINE: Final[Mapping[str, frozenset[str]]] = {
    name: frozenset(handlers) for name, handlers in HANDLERS.items()
}

EFFECT_TABLES: Final[Mapping[str, tuple[str, ...]]] = {
    "inventory": ("reservations", "releases"),
    "payments": ("charges",),
    "shipping": ("shipments",),
}
