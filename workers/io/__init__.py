"""The only code that talks to Postgres and RabbitMQ."""
