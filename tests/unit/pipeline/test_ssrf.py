"""The address guard: host normalisation, address classes, allow-list by origin and CIDR (no network)."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from harness.fakes import FakeDNS
from service.errors import FetchError
from service.pipeline.ssrf import AddressPolicy, blocked_reason, normalise_host, parse_inet_aton
from service.settings import Settings


def refused(policy: AddressPolicy, scheme: str, host: str, port: int | None = None) -> FetchError:
    with pytest.raises(FetchError) as info:
        policy.check(scheme, host, port)
    return info.value


@pytest.mark.parametrize("spelling", ["2130706433", "0x7f000001", "0x7f.1", "127.1", "0177.0.0.1", "127.0.1",
                                      "0x7F.0.0.1", "127.0.0.1.", "017700000001"])
def test_numeric_spellings_of_loopback_normalise_like_the_resolver(spelling: str) -> None:
    assert normalise_host(spelling) == "127.0.0.1"
    assert socket.inet_aton(spelling.lower().rstrip(".")) == ipaddress.IPv4Address("127.0.0.1").packed


@pytest.mark.parametrize("spelling", ["256.0.0.1", "1.2.3.4.5", "08.0.0.1", "0x", "1.2.3.16777216"])
def test_numeric_spellings_out_of_range_are_invalid_url(spelling: str) -> None:
    with pytest.raises(FetchError) as info:
        parse_inet_aton(spelling)
    assert info.value.code == "invalid_url"


@pytest.mark.parametrize("host, expected", [("[::FFFF:127.0.0.1]", "::ffff:7f00:1"),
                                            ("Images.Example.COM.", "images.example.com"), ("[0:0:0:0:0:0:0:1]", "::1")])
def test_hosts_are_normalised(host: str, expected: str) -> None:
    assert normalise_host(host) == expected


@pytest.mark.parametrize("host", ["exa mple.com", "a..b", "-", "ex\u00e4mple.com", "[::1"])
def test_malformed_hosts_are_invalid_url(host: str) -> None:
    with pytest.raises(FetchError) as info:
        normalise_host(host)
    assert info.value.code == "invalid_url"


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.255.0.9", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "169.254.0.1",
    "100.64.0.1", "100.127.255.254", "0.0.0.0", "0.1.2.3", "224.0.0.1", "239.255.255.250", "255.255.255.255",
    "240.0.0.1", "192.0.2.1", "198.18.0.1", "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::127.0.0.1", "64:ff9b::7f00:1",
    "64:ff9b::a9fe:a9fe", "64:ff9b:1::808:808", "2002:7f00:1::", "2002:a9fe:a9fe::1", "2001:db8::1",
    "2001::1",
])
def test_non_public_addresses_are_blocked(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111",
                                     "64:ff9b::808:808", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is None


def test_metadata_address_is_refused_with_its_reason() -> None:
    err = refused(AddressPolicy(), "http", "169.254.169.254")
    assert err.code == "url_not_allowed"
    assert "link-local" in err.message and "GREENSERVE_FETCH_ALLOW" in err.message


def test_a_public_name_is_pinned_to_its_checked_address() -> None:
    dns = FakeDNS({"images.example.com": ["93.184.216.34"]})
    target = AddressPolicy(resolver=dns).check("https", "Images.Example.com", None)
    assert (target.host, target.port, target.address) == ("images.example.com", 443, "93.184.216.34")
    assert dns.asked == ["images.example.com"]


def test_every_resolved_address_is_checked() -> None:
    dns = FakeDNS({"mixed.example.com": ["93.184.216.34", "2606:4700::1", "10.0.0.7"]})
    err = refused(AddressPolicy(resolver=dns), "http", "mixed.example.com")
    assert err.code == "url_not_allowed" and "10.0.0.7" in err.message


def test_loopback_by_name_is_refused() -> None:
    dns = FakeDNS({"localhost": ["127.0.0.1", "::1"]})
    assert refused(AddressPolicy(resolver=dns), "http", "localhost", 8080).code == "url_not_allowed"


def test_numeric_hosts_are_never_sent_to_the_resolver() -> None:
    dns = FakeDNS({})
    assert refused(AddressPolicy(resolver=dns), "http", "0x7f.1").code == "url_not_allowed"
    assert dns.asked == []


def test_unresolvable_host_is_fetch_failed() -> None:
    assert refused(AddressPolicy(resolver=FakeDNS({})), "http", "nowhere.example").code == "fetch_failed"


@pytest.mark.parametrize("scheme", ["file", "ftp", "gopher", "dict", "ldap", ""])
def test_non_http_schemes_are_refused(scheme: str) -> None:
    assert refused(AddressPolicy(), scheme, "93.184.216.34").code == "url_not_allowed"


def test_allowed_origin_matches_scheme_host_and_port_only() -> None:
    dns = FakeDNS({"localhost": ["127.0.0.1"]})
    policy = AddressPolicy(["http://127.0.0.1:9000"], resolver=dns)
    assert policy.check("http", "127.0.0.1", 9000).address == "127.0.0.1"
    assert policy.check("http", "2130706433", 9000).address == "127.0.0.1"  # same origin, other spelling
    for scheme, host, port in [("http", "127.0.0.1", 9001), ("https", "127.0.0.1", 9000),
                               ("http", "localhost", 9000), ("http", "127.0.0.2", 9000), ("http", "127.0.0.1", None)]:
        assert refused(policy, scheme, host, port).code == "url_not_allowed", (scheme, host, port)


def test_allowed_origin_with_a_private_name_is_pinned_to_its_address() -> None:
    dns = FakeDNS({"images.internal": ["10.0.0.5"]})
    policy = AddressPolicy(["https://images.internal"], resolver=dns)
    assert policy.check("https", "images.internal", 443).address == "10.0.0.5"
    assert refused(policy, "http", "images.internal", 80).code == "url_not_allowed"


def test_allowed_cidr_lets_its_addresses_through_on_any_port() -> None:
    dns = FakeDNS({"cache.internal": ["10.20.0.9"], "mixed.internal": ["10.20.0.9", "192.168.0.1"]})
    policy = AddressPolicy(["10.20.0.0/16", "fd00::/8"], resolver=dns)
    assert policy.check("http", "10.20.1.2", 81).address == "10.20.1.2"
    assert policy.check("https", "cache.internal", None).address == "10.20.0.9"
    assert policy.check("http", "[fd00::5]", None).address == "fd00::5"
    assert policy.check("http", "::ffff:10.20.0.1", None).address == "::ffff:a14:1"
    assert refused(policy, "http", "10.21.0.1").code == "url_not_allowed"
    assert refused(policy, "http", "mixed.internal").code == "url_not_allowed"


def test_base_url_origin_is_allowed_implicitly() -> None:
    settings = Settings(image_base_url="http://127.0.0.1:8123/album/")
    policy = AddressPolicy.from_settings(settings)
    assert policy.check("http", "127.0.0.1", 8123).address == "127.0.0.1"
    assert refused(policy, "http", "127.0.0.1", 8124).code == "url_not_allowed"


def test_allow_list_is_read_from_the_environment() -> None:
    settings = Settings.from_env({"GREENSERVE_FETCH_ALLOW": "http://10.0.0.5:9000, 192.168.7.0/24"})
    policy = AddressPolicy.from_settings(settings)
    assert policy.check("http", "10.0.0.5", 9000).address == "10.0.0.5"
    assert policy.check("https", "192.168.7.7", 8443).address == "192.168.7.7"
    assert refused(policy, "http", "10.0.0.5", 9001).code == "url_not_allowed"
