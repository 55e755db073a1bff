"""The engine's outbox publisher worker: the shared outbox publisher
(``workers.runtime.outbox``) over the engine's outbox, retiring the submits that must
never be sent as it samples."""

from __future__ import annotations

from workers.engine import context, transitions
from workers.runtime import outbox, probes, supervisor
from workers.settings import Settings

ACTOR = outbox.ACTOR


async def main(settings: Settings, stop: supervisor.Stop, health: probes.Health) -> None:
    async with context.running(settings, ACTOR, health) as ctx:
        pub = await ctx.engine_outbox(
            before_sample=lambda tx: transitions.retire_submits(tx, ACTOR)
        )
        waker = supervisor.Waker(settings.poll_interval_s)
        await supervisor.supervise(
            main=[outbox.loop(pub, stop, waker, ctx.reacquire, ACTOR)],
            side=[
                ctx.heartbeat(),
                waker.follow(lambda: ctx.db.listen("custody_outbox"), worker=ACTOR),
            ],
        )
