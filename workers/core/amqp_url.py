"""``CUSTODY_AMQP_URL`` with one node or several nodes of one RabbitMQ cluster.

The syntax is libpq's host list inside one URL::

    amqp[s]://[user[:password]@]host[:port][,host[:port]...][/vhost][?options]

for example ``amqp://custody-publisher:pw@rabbit-0:5672,rabbit-1:5672,rabbit-2/%2F``.
A cluster's nodes share users, vhosts and options, so the URL has one of each; the
port of a node without one is the scheme's (5672, or 5671 for ``amqps``). IPv6
addresses are bracketed (``[fd00::1]:5672``). A one-host URL is the single-URL form,
used exactly as given. A comma-separated list of whole URLs is refused, with this
syntax in the message.

Pure: parsing and formatting only, for the broker, the harnesses and the CLI.
"""

from __future__ import annotations

import random
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from workers.errors import ConfigError

SCHEMES = ("amqp", "amqps")
DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "http": 15672, "https": 15671}
SETTING = "CUSTODY_AMQP_URL"
SYNTAX = "amqp[s]://user:password@host1[:port],host2[:port],.../vhost"
_HOSTNAME = re.compile(r"^[A-Za-z0-9._~%!$&'()*+;=-]*$")
_URL_IN_REST = re.compile(r",\s*[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class Node:
    """One node of the list: its host as written (brackets kept) and its port, if any."""

    host: str
    port: int | None
    default_port: int

    @property
    def netloc(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """``host:port`` with the default port filled in: what logs and events show."""
        return f"{self.host}:{self.port or self.default_port}"


@dataclass(frozen=True)
class AmqpUrl:
    """A parsed URL; the raw (percent-encoded) pieces are kept, so that formatting gives
    back exactly what was parsed."""

    scheme: str
    userinfo: str | None  # "user:password", still percent-encoded; None: no "@"
    nodes: tuple[Node, ...]
    rest: str  # "/vhost?options#fragment", raw

    def __str__(self) -> str:
        return self._format(",".join(n.netloc for n in self.nodes))

    def _format(self, netloc: str) -> str:
        creds = "" if self.userinfo is None else f"{self.userinfo}@"
        return f"{self.scheme}://{creds}{netloc}{self.rest}"

    def node_urls(self) -> list[str]:
        """One single-host URL per node, in the list's order (user, vhost, options kept)."""
        return [self._format(n.netloc) for n in self.nodes]

    def shuffled(self, rng: random.Random) -> list[str]:
        """The node URLs in an order of this process's own (replicas spread)."""
        urls = self.node_urls()
        rng.shuffle(urls)
        return urls

    @property
    def user(self) -> str:
        raw = (self.userinfo or "").partition(":")[0]
        return urllib.parse.unquote(raw) or "guest"

    @property
    def password(self) -> str:
        raw = (self.userinfo or "").partition(":")[2]
        return urllib.parse.unquote(raw) if raw else "guest"

    @property
    def vhost(self) -> str:
        path = re.split(r"[?#]", self.rest, maxsplit=1)[0]
        return urllib.parse.unquote(path[1:]) if len(path) > 1 else "/"

    def with_user(self, user: str, password: str) -> AmqpUrl:
        quoted = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}"
        nodes = self.nodes
        if len(nodes) == 1 and not nodes[0].host:
            nodes = (replace(nodes[0], host="127.0.0.1"),)
        return replace(self, userinfo=quoted, nodes=nodes)

    def with_vhost(self, vhost: str) -> AmqpUrl:
        """The same URL (nodes, user, options) for another vhost."""
        options = re.search(r"[?#]", self.rest)
        tail = self.rest[options.start() :] if options else ""
        return replace(self, rest="/" + urllib.parse.quote(vhost, safe="") + tail)

    def with_addresses(self, addresses: Sequence[str]) -> AmqpUrl:
        """The same URL (user, vhost, options) naming other nodes (``host[:port]`` each)."""
        return replace(self, nodes=_nodes(",".join(addresses), self.scheme, SETTING))


def parse(url: str, *, setting: str = SETTING, schemes: Sequence[str] = SCHEMES) -> AmqpUrl:
    """Parse a one-host or several-host URL; a :class:`ConfigError` names ``setting`` and
    the mistake (never the password)."""
    scheme, sep, tail = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in schemes:
        wanted = " or ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{setting} must start with {wanted} ({SYNTAX})")
    end = len(tail)
    for mark in "/?#":
        at = tail.find(mark)
        if at != -1:
            end = min(end, at)
    authority, rest = tail[:end], tail[end:]
    if _URL_IN_REST.search(rest):
        raise ConfigError(
            f"{setting}: give one URL with several hosts ({SYNTAX}), not a list of URLs"
        )
    userinfo: str | None = None
    if "@" in authority:
        userinfo, _, authority = authority.rpartition("@")
    return AmqpUrl(scheme, userinfo, _nodes(authority, scheme, setting), rest)


def _nodes(hosts: str, scheme: str, setting: str) -> tuple[Node, ...]:
    parts = hosts.split(",")
    default = DEFAULT_PORTS.get(scheme, 5672)
    out = []
    for part in parts:
        part = part.strip()
        if not part and len(parts) > 1:
            raise ConfigError(f"{setting}: an empty host in the host list ({SYNTAX})")
        out.append(_node(part, default, setting))
    return tuple(out)


def _node(text: str, default: int, setting: str) -> Node:
    if text.startswith("["):
        close = text.find("]")
        if close == -1:
            raise ConfigError(f"{setting}: an IPv6 host without its closing bracket")
        host, after = text[: close + 1], text[close + 1 :]
        if after and not after.startswith(":"):
            raise ConfigError(f"{setting}: {text!r} is not a host[:port]")
        port_text = after[1:] if after else None
    else:
        host, colon, port_text_raw = text.partition(":")
        port_text = port_text_raw if colon else None
        if not _HOSTNAME.match(host):
            raise ConfigError(f"{setting}: {host!r} is not a host name")
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(f"{setting}: {port_text!r} is not a port (1-65535)")
        port = int(port_text)
    return Node(host, port, default)


def management_bases(url: str) -> list[tuple[str, str, str]]:
    """``CUSTODY_AMQP_MANAGEMENT_URL`` (one node or a host list, like the AMQP URL): the
    ``scheme://host[:port]`` of each node (no port: the scheme's own, as before), with the
    URL's user and password (guest when absent), for the management HTTP API, which any
    node of a cluster answers."""
    parsed = parse(url, setting="CUSTODY_AMQP_MANAGEMENT_URL", schemes=("http", "https"))
    bases = []
    for n in parsed.nodes:
        netloc = n.host or "127.0.0.1"
        if n.port is not None:
            netloc += f":{n.port}"
        bases.append((f"{parsed.scheme}://{netloc}", parsed.user, parsed.password))
    return bases
