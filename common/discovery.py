"""Where the replicas of a service are: addresses as given, or DNS names that resolve to several.

A target is either `host:port`, one replica reached as written, or gRPC's `dns:///name:port`,
every address the name resolves to (a Kubernetes headless Service resolves to its ready pods),
resolved again every `refresh_s` so that a scaled Deployment is picked up without a restart.
`resolve_names` also tells which name each address came from (over TLS, the name its certificate
must carry; common/tls.py).

`rendezvous` places a key (e.g. `affinity_key` of a prompt) on one replica of a set (highest random weight hashing): every key
keeps its replica when replicas join or leave, except the keys of a replica that left and the
share a new replica takes over, about 1/n of them.

Every replica set of the stack (the router's schedulers, a scheduler's workers, its drafters) is kept with
these: `parse_targets` reads its flag, `membership_changes` says who joined and left at each refresh, and
`place` puts a prompt on its affinity replica unless that one is busier than the least busy by more than a
slack.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import Collection, Mapping, Sequence

DNS_SCHEME = "dns:///"


def parse_targets(text: str, flag: str) -> list[str]:
    """The comma-separated targets of an address flag; ValueError naming the flag when it names none."""
    targets = [part.strip() for part in text.split(",") if part.strip()]
    if not targets:
        raise ValueError(f"{flag} names no replica")
    return targets


def is_dns_target(target: str) -> bool:
    return target.startswith(DNS_SCHEME)


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6 address]:port"; ValueError when there is no port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(targets: Sequence[str]) -> list[str]:
    """Every replica address the targets name, sorted and deduplicated. A DNS target that does not
    resolve names no replica for now (it may come back at the next refresh)."""
    return sorted(await resolve_names(targets))


async def resolve_names(targets: Sequence[str]) -> dict[str, str | None]:
    """`resolve`'s addresses, each with the DNS name it was resolved from (None for an address given as
    is): the name a replica's TLS certificate is checked against, as gRPC checks a `dns:///` target's."""
    loop = asyncio.get_running_loop()
    addresses: dict[str, str | None] = {}
    for target in targets:
        if not is_dns_target(target):
            addresses.setdefault(target, None)
            continue
        host, port = split_host_port(target.removeprefix(DNS_SCHEME))
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        for info in infos:
            addresses.setdefault(join_host_port(info[4][0], port), host)
    return addresses


async def membership_changes(targets: Sequence[str], known: Collection[str]
                             ) -> tuple[dict[str, str | None], list[str]]:  # fmt: skip
    """Resolve the targets again: the addresses not in `known` (each with the DNS name it came from, as
    resolve_names gives it) and the known ones no target names any more, both sorted."""
    names = await resolve_names(targets)
    return {a: names[a] for a in sorted(names) if a not in known}, sorted(set(known) - set(names))


def _weight(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest(), "big")


def rendezvous(key: str, replicas: Sequence[str]) -> str:
    """The replica of `key` among `replicas` (non-empty): the one with the highest weight for it."""
    return max(replicas, key=lambda replica: _weight(key, replica))


AFFINITY_TOKENS = 64
"""At most this many leading prompt tokens choose a request's replica (a chat's turns share them)."""
AFFINITY_ALIGN = 16
"""The prefix is cut to a multiple of this many tokens, so that a later turn, which repeats the earlier ones and
adds to them, keeps the same prefix once it is this long."""


def affinity_key(prompt_token_ids: Sequence[int]) -> str:
    """The leading prompt tokens that choose a prompt's replica, as a rendezvous key: up to AFFINITY_TOKENS,
    cut to a multiple of AFFINITY_ALIGN (a prompt shorter than AFFINITY_ALIGN: all of it)."""
    length = min(len(prompt_token_ids), AFFINITY_TOKENS)
    if length >= AFFINITY_ALIGN:
        length -= length % AFFINITY_ALIGN
    return ",".join(map(str, prompt_token_ids[:length]))


def place(prompt_token_ids: Sequence[int], loads: Mapping[str, tuple[int, ...]], slack: int) -> str | None:
    """The replica for a prompt among `loads` (address -> its load, smaller is less loaded, the first entry in
    requests): its affinity replica (rendezvous on affinity_key), unless that one has more than `slack` requests
    more than the least loaded, which then takes it. None when `loads` is empty."""
    if not loads:
        return None
    preferred = rendezvous(affinity_key(prompt_token_ids), list(loads))
    least = min(loads, key=loads.__getitem__)
    return preferred if loads[preferred][0] <= loads[least][0] + slack else least
