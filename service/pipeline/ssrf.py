"""The address guard: which hosts the fetcher may reach, and a transport that connects only there.

Callers choose the URLs, so every hop (the first URL and each redirect) goes through ``AddressPolicy.check``:

    1. only ``http``/``https``;
    2. the host is normalised the way the resolver reads it (``2130706433``, ``0x7f.1``, ``127.1`` and
       ``0177.0.0.1`` are all 127.0.0.1; IPv6 in its compressed form);
    3. an origin on the allow-list (``GREENSERVE_FETCH_ALLOW`` plus the origin of
       ``GREENSERVE_IMAGE_BASE_URL``) is let through;
    4. otherwise the host is resolved once and *every* address must be globally routable or inside an
       allowed CIDR; IPv4-mapped, IPv4-compatible, NAT64 and 6to4 forms are judged by the IPv4 inside;
    5. the returned ``Target`` pins the checked addresses: ``GuardedAdapter`` connects to exactly those
       (no second lookup a rebinding DNS server could answer differently) while the Host header, TLS SNI
       and certificate check keep the hostname.

requests-hardened was considered: it has one switch for loopback and no allow-list by origin or CIDR, so
it could not let the operator's own host on 127.0.0.1:9000 through while refusing every other loopback
port.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections import namedtuple
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import requests.adapters
from gevent import socket as gsocket
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
from urllib3.poolmanager import PoolKey, _default_key_normalizer
from urllib3.util.timeout import Timeout

from service.errors import FetchError
from service.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]

SCHEMES = {"http": 80, "https": 443}
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_V4_COMPAT = ipaddress.ip_network("::/96")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
_HOSTNAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$")
_HINT = "operators can allow their own hosts with GREENSERVE_FETCH_ALLOW"


def url_not_allowed(message: str, *, hint: bool = True) -> FetchError:
    return FetchError(f"{message}; {_HINT}" if hint else message, code="url_not_allowed")


def invalid_url(message: str) -> FetchError:
    return FetchError(message, code="invalid_url")


def parse_inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address BSD ``inet_aton`` (and so getaddrinfo) reads in ``host``, or None if not numeric.

    1-4 parts, each decimal, ``0x`` hex or ``0`` octal; the last part fills the remaining bytes.
    A host whose last label is numeric is an address or nothing (as in the WHATWG URL standard): other
    spellings raise ``invalid_url`` rather than going to DNS, where a resolver might read them its own way.
    """
    parts = host.split(".")
    if not _NUMERIC_LABEL.match(parts[-1]):
        return None
    if len(parts) > 4 or not all(_NUMERIC_LABEL.match(p) for p in parts):
        raise invalid_url(f"host {host!r} is neither a valid IPv4 address nor a host name")
    try:
        values = [int(p, 16) if p.startswith("0x") else int(p, 8) if len(p) > 1 and p[0] == "0" else int(p)
                  for p in parts]
    except ValueError:  # e.g. "08" (not octal) or a bare "0x"
        raise invalid_url(f"host {host!r} is neither a valid IP address nor a host name") from None
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (5 - len(parts)):
        raise invalid_url(f"host {host!r} is a numeric address out of range")
    number = last
    for i, v in enumerate(head):
        number += v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def normalise_host(host: str) -> str:
    """The canonical spelling of ``host``: dotted-quad IPv4, compressed IPv6, or a lowercase DNS name."""
    if host.startswith("[") != host.endswith("]"):
        raise invalid_url(f"host {host!r} has unbalanced brackets")
    host = host.strip("[]").lower().rstrip(".")
    if not host:
        raise invalid_url("the URL has no host")
    if ":" in host:
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise invalid_url(f"host {host!r} is not a valid IPv6 address") from None
    v4 = parse_inet_aton(host)
    if v4 is not None:
        return str(v4)
    if not _HOSTNAME.match(host) or len(host) > 253:
        raise invalid_url(f"host {host!r} is not a valid host name")
    return host


def blocked_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` must not be fetched from (not globally routable), or None when it is public."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return "a local-use NAT64 address (64:ff9b:1::/48)"
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and (ip in _NAT64 or ip in _V4_COMPAT and int(ip) > 1):
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:  # the IPv4 inside decides, whatever the IPv6 wrapper
            reason = blocked_reason(inner)
            return f"an IPv6 form of {inner}, {reason}" if reason else None
    for test, reason in ((ip.is_unspecified, "an unspecified address (it reaches this machine)"),
                         (ip.is_loopback, "a loopback address"),
                         (ip.is_link_local, "a link-local address (cloud metadata lives at 169.254.169.254)"),
                         (ip.is_multicast, "a multicast address"),
                         (ip in _CGNAT, "a carrier-grade NAT address (100.64.0.0/10)"),
                         (ip.is_private, "a private address"), (ip.is_reserved, "a reserved address"),
                         (not ip.is_global, "not a globally routable address")):
        if test:
            return reason
    return None


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (gevent's resolver: the hub waits, a thread asks)."""
    infos = gsocket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Target:
    """A checked destination: connect to one of ``addresses`` (all checked, in resolver order), speak to
    ``host`` in HTTP and TLS."""

    scheme: str
    host: str
    port: int
    addresses: tuple[str, ...]

    @property
    def address(self) -> str:
        return self.addresses[0]


class AddressPolicy:
    """Decides, per URL hop, whether and where the fetcher may connect."""

    def __init__(self, allow: Iterable[str] = (), *, resolver: Resolver = resolve) -> None:
        self.origins: set[tuple[str, str, int]] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.resolver = resolver
        for entry in allow:
            if "://" in entry:
                parts = urlsplit(entry.strip())
                scheme = parts.scheme.lower()
                self.origins.add((scheme, normalise_host(parts.hostname or ""), parts.port or SCHEMES[scheme]))
            else:
                self.networks.append(ipaddress.ip_network(entry.strip(), strict=False))

    @classmethod
    def from_settings(cls, settings: Settings, *, resolver: Resolver = resolve) -> AddressPolicy:
        """GREENSERVE_FETCH_ALLOW plus the origin of GREENSERVE_IMAGE_BASE_URL."""
        base = (settings.base_origin,) if settings.base_origin else ()
        return cls((*settings.fetch_allow, *base), resolver=resolver)

    def check(self, scheme: str, host: str | None, port: int | None) -> Target:
        """The pinned target for one hop, or ``FetchError`` (``invalid_url`` / ``url_not_allowed``)."""
        scheme = (scheme or "").lower()
        if scheme not in SCHEMES:
            raise url_not_allowed(f"scheme {scheme!r} is not fetched (only http and https)", hint=False)
        name = normalise_host(host or "")
        port = port or SCHEMES[scheme]
        literal = _ip_or_none(name)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in self.resolver(name, port)]
            except (OSError, UnicodeError) as exc:
                raise FetchError(f"could not resolve host {name!r} ({exc})", code="fetch_failed") from exc
            if not addresses:
                raise FetchError(f"host {name!r} has no addresses", code="fetch_failed")
        if (scheme, name, port) not in self.origins:
            for ip in addresses:
                reason = None if self._in_allowed_network(ip) else blocked_reason(ip)
                if reason:
                    spelled = "" if normalise_host(host or "") == (host or "").lower() else f" (read as {name})"
                    where = f"{scheme}://{_netloc(host or '', port)}{spelled}"
                    shown = where if literal is not None else f"{where} (resolves to {ip})"
                    raise url_not_allowed(f"{shown} is {reason}; the fetcher only reaches public addresses")
        return Target(scheme, name, port, tuple(str(ip) for ip in addresses))

    def _in_allowed_network(self, ip: IPAddress) -> bool:
        candidates = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            candidates.append(ip.ipv4_mapped)
        return any(c in net for c in candidates for net in self.networks if c.version == net.version)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip_or_none(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# ---------------------------------------------------------------------- the pinned transport


class _PinnedConnectionMixin:
    """Connects to the ``pinned_ips`` the policy checked, in order, instead of resolving ``host`` again."""

    def __init__(self, *args: Any, pinned_ips: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pinned_ips = pinned_ips

    def _new_conn(self) -> socket.socket:
        conn: Any = self
        error: OSError | None = None
        for ip in self.pinned_ips:  # like urllib3's create_connection: the next address when one fails
            # gevent's socket whether or not the process is monkey-patched: the hub waits, never blocks
            sock = gsocket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
            try:
                for option in conn.socket_options or ():
                    sock.setsockopt(*option)
                sock.settimeout(Timeout.resolve_default_timeout(conn.timeout))
                sock.connect((ip, conn.port))
                return cast(socket.socket, sock)
            except OSError as exc:
                sock.close()
                error = exc
        where = f"{conn.host} ({', '.join(self.pinned_ips)})"
        if isinstance(error, socket.timeout):
            raise ConnectTimeoutError(conn, f"connecting to {where} timed out") from error
        raise NewConnectionError(conn, f"could not connect to {where}: {error}") from error


class PinnedHTTPConnection(_PinnedConnectionMixin, HTTPConnection):
    pass


class PinnedHTTPSConnection(_PinnedConnectionMixin, HTTPSConnection):
    pass  # SNI and certificate matching use ``host`` (the name), not the pinned address


class _PinnedHTTPPool(HTTPConnectionPool):
    ConnectionCls = PinnedHTTPConnection


class _PinnedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = PinnedHTTPSConnection


# Pools are keyed by the pinned address too: a host that resolves elsewhere later gets a fresh pool.
_PinnedPoolKey = namedtuple("_PinnedPoolKey", (*PoolKey._fields, "key_pinned_ips"))  # type: ignore[misc]


class GuardedAdapter(requests.adapters.HTTPAdapter):
    """A requests adapter that checks every request (so every redirect hop) and connects to the checked IP."""

    def __init__(self, policy: AddressPolicy, **kwargs: Any) -> None:
        self.policy = policy
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        # urllib3 types the key class as its own PoolKey; ours is that namedtuple plus the pinned address
        key_fn = functools.partial(_default_key_normalizer, _PinnedPoolKey)  # type: ignore[arg-type]
        self.poolmanager.key_fn_by_scheme = {"http": key_fn, "https": key_fn}
        self.poolmanager.pool_classes_by_scheme = {"http": _PinnedHTTPPool, "https": _PinnedHTTPSPool}

    def get_connection_with_tls_context(self, request: requests.PreparedRequest, verify: Any,
                                        proxies: Any = None, cert: Any = None) -> HTTPConnectionPool:
        if proxies and any(proxies.values()):
            raise invalid_url("the image fetcher does not use proxies")
        try:
            # the very host/port urllib3 will speak to: no second parser to disagree with the check
            host_params, pool_kwargs = self.build_connection_pool_key_attributes(request, verify, cert)
        except ValueError as exc:
            raise invalid_url(f"the URL cannot be parsed ({exc})") from exc
        target = self.policy.check(host_params["scheme"], host_params["host"], host_params["port"])
        pool_kwargs["pinned_ips"] = target.addresses
        return self.poolmanager.connection_from_host(**host_params, pool_kwargs=pool_kwargs)
