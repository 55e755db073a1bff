-- Business tables of the sample participants, in each participant's own schema.
-- No unique constraint on the effect tables on purpose: a doubled effect must be
-- visible as two rows, so that the tests that count effects can fail.

CREATE TABLE IF NOT EXISTS stock (
  sku       text PRIMARY KEY,
  available integer NOT NULL CHECK (available >= 0)
);
INSERT INTO stock (sku, available) VALUES ('sku-1', 100000000), ('sku-2', 100000000),
  ('sku-rare', 3)
ON CONFLICT (sku) DO NOTHING;

CREATE TABLE IF NOT EXISTS reservations (
  id           bigserial PRIMARY KEY,
  operation_id uuid NOT NULL,
  order_id     text NOT NULL,
  sku          text NOT NULL,
  quantity     integer NOT NULL,
  at           timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS releases (
  id           bigserial PRIMARY KEY,
  operation_id uuid NOT NULL,
  order_id     text NOT NULL,
  sku          text NOT NULL,
  quantity     integer NOT NULL,
  at           timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS charges (
  id           bigserial PRIMARY KEY,
  operation_id uuid NOT NULL,
  order_id     text NOT NULL,
  amount_cents bigint NOT NULL,
  at           timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS shipments (
  id           bigserial PRIMARY KEY,
  operation_id uuid NOT NULL,
  order_id     text NOT NULL,
  address      text NOT NULL,
  at           timestamptz NOT NULL DEFAULT now()
);
