"""The Celery peer: the app its workers run (``celery -A bench.celery_app worker``) and
the bench submits to.

Set up the way a careful user sets Celery up for work that must not be lost: a durable
RabbitMQ **quorum** queue, persistent messages, publisher confirms
(``confirm_publish``), acknowledgement after the task ran (``task_acks_late``) and a
redelivery if a pool process dies mid-task (``task_reject_on_worker_lost``). A workflow
is a ``chain`` of three ``bench.step`` tasks; each writes its effect row once
(``bench/peers.py``). No result backend: a chain does not need one, and the effect rows
are the results.

The broker and the database come from ``BENCH_CELERY_BROKER`` and ``BENCH_CELERY_DB``
(the bench sets them for the worker it starts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from celery import Celery, chain  # type: ignore[import-untyped, import-not-found, unused-ignore]

from bench.peers import INSERT_EFFECT, INSERT_REDELIVERY, STEPS

QUEUE: Final = "bench.celery.steps"
TASK: Final = "bench.step"

app: Any = Celery("bench_celery")
app.conf.update(
    broker_url=os.environ.get("BENCH_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
    broker_transport_options={"confirm_publish": True},
    broker_connection_retry_on_startup=True,
    # the default queue, declared by Celery itself as a durable quorum queue
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    task_default_queue_type="quorum",
    task_default_delivery_mode="persistent",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    worker_detect_quorum_queues=True,
    worker_hijack_root_logger=False,
)

_conn: psycopg.Connection[tuple[Any, ...]] | None = None


def _db() -> psycopg.Connection[tuple[Any, ...]]:
    """One connection per pool process, opened by its first task (after the fork)."""
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(
            os.environ["BENCH_CELERY_DB"], autocommit=True, application_name="bench-celery-task"
        )
    return _conn


def _step(_previous: object, workflow: str, step: int) -> int:
    """One step: its effect row, exactly once. A chain passes the previous step's
    return value first."""
    conn = _db()
    if conn.execute(INSERT_EFFECT, (workflow, step)).fetchone() is None:
        conn.execute(INSERT_REDELIVERY, (workflow, step))
    return step


step_task: Any = app.task(name=TASK, acks_late=True)(_step)


def workflow(workflow_id: str) -> Any:
    """The chain of the three steps of one workflow."""
    return chain(
        step_task.s(0, workflow_id, 1),
        *(step_task.s(workflow_id, n) for n in range(2, STEPS + 1)),
    )


def submit(broker_url: str, workflow_ids: Sequence[str]) -> float:
    """Publish one chain per workflow (each publish waits for its confirm); seconds."""
    app.conf.broker_url = broker_url
    started = time.monotonic()
    with app.producer_or_acquire() as producer:
        for wf in workflow_ids:
            workflow(wf).apply_async(producer=producer)
    return time.monotonic() - started
