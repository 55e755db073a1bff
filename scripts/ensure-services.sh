#!/usr/bin/env bash
# Make sure Postgres and RabbitMQ (with its management plugin) are reachable.
# Starts locally installed services that are stopped; otherwise says exactly what is
# missing and how to start it. Used by `make demo`, `make test` and .ci/run.
set -u
PGHOST_=${CUSTODY_PGHOST:-127.0.0.1}
PGPORT_=${CUSTODY_PGPORT:-5432}
AMQP_PORT=${CUSTODY_AMQP_PORT:-5672}
MGMT_PORT=${CUSTODY_MGMT_PORT:-15672}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
wait_port() { for _ in $(seq 1 "$3"); do port_open "$1" "$2" && return 0; sleep 1; done; return 1; }

if ! port_open "$PGHOST_" "$PGPORT_"; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo "ensure-services: starting the local PostgreSQL cluster"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    echo "ensure-services: starting postgres with docker compose (deploy/compose.yaml)"
    docker compose -f deploy/compose.yaml up -d postgres || true
  fi
  if ! wait_port "$PGHOST_" "$PGPORT_" 30; then
    echo "ensure-services: PostgreSQL is not reachable at $PGHOST_:$PGPORT_." >&2
    echo "  start it with: pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start" >&2
    echo "  or, with a container engine: docker compose -f deploy/compose.yaml up -d postgres" >&2
    exit 1
  fi
fi

if ! port_open 127.0.0.1 "$AMQP_PORT"; then
  if command -v rabbitmq-server >/dev/null 2>&1; then
    echo "ensure-services: starting the local RabbitMQ node"
    rabbitmq-server -detached || true
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    echo "ensure-services: starting rabbitmq with docker compose (deploy/compose.yaml)"
    docker compose -f deploy/compose.yaml up -d rabbitmq || true
  fi
  if ! wait_port 127.0.0.1 "$AMQP_PORT" 60; then
    echo "ensure-services: RabbitMQ is not reachable at 127.0.0.1:$AMQP_PORT." >&2
    echo "  start it with: rabbitmq-server -detached" >&2
    echo "  or, with a container engine: docker compose -f deploy/compose.yaml up -d rabbitmq" >&2
    exit 1
  fi
fi

if ! port_open 127.0.0.1 "$MGMT_PORT"; then
  if command -v rabbitmq-plugins >/dev/null 2>&1; then
    echo "ensure-services: enabling rabbitmq_management and rabbitmq_prometheus"
    rabbitmq-plugins enable rabbitmq_management rabbitmq_prometheus >/dev/null || true
  fi
  if ! wait_port 127.0.0.1 "$MGMT_PORT" 60; then
    echo "ensure-services: the RabbitMQ management API is not reachable at 127.0.0.1:$MGMT_PORT." >&2
    echo "  enable it with: rabbitmq-plugins enable rabbitmq_management" >&2
    exit 1
  fi
fi
echo "ensure-services: PostgreSQL $PGHOST_:$PGPORT_, RabbitMQ 127.0.0.1:$AMQP_PORT (management :$MGMT_PORT) are up"
