"""TLS options for the broker connection: verified against a CA, fail closed."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Env
from workers import errors
from workers.io import broker


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    """A throwaway self-signed CA certificate (openssl), in PEM."""
    key, cert = tmp_path / "ca.key", tmp_path / "ca.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=custody-test-ca",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert


def test_the_tls_context_trusts_exactly_the_configured_ca(ca: Path) -> None:
    context = broker.Tls(ca_file=str(ca)).context()
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "custody-test-ca"),),)
    ]
    assert context.minimum_version is ssl.TLSVersion.TLSv1_2


def test_unreadable_tls_files_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="AMQP TLS files"):
        broker.Tls(ca_file=str(tmp_path / "missing.pem")).context()


async def test_tls_files_with_a_plain_amqp_url_are_refused(ca: Path, env: Env) -> None:
    """Configured TLS never silently falls back to a plain connection."""
    plain = broker.Broker(env.settings.amqp_url, "tls-test", broker.Tls(ca_file=str(ca)))
    with pytest.raises(errors.ConfigError, match="amqps://"):
        await plain.connect()


async def test_a_tls_handshake_with_a_plain_listener_fails_closed(ca: Path, env: Env) -> None:
    """amqps:// against a plain listener: the connection fails, nothing is sent in clear."""
    url = env.settings.amqp_url.replace("amqp://", "amqps://", 1)
    tls = broker.Broker(url, "tls-test", broker.Tls(ca_file=str(ca)))
    with pytest.raises(errors.BrokerError, match="cannot connect"):
        await tls.connect()
