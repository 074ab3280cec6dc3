"""TLS for segserve's gRPC servers and channels: PEM files in, grpc credentials, ports and channels out.

A leaf module (stdlib and grpc only), so every service may import it. `TlsFiles` names one endpoint's
PEM files (all empty = plaintext, as without TLS):

- a server with a certificate and key serves TLS (`add_port`); with a CA as well it requires every client
  to present a certificate signed by that CA (mutual TLS, the internal hops);
- a channel with a CA verifies the server's certificate against it (`open_channel`; no CA = the system's
  roots); with a certificate and key as well it presents them as its client certificate.

The internal hops (router -> scheduler -> worker and drafters) use mutual TLS when a service is given all
three of its `internal_tls_*` files (`internal_tls`). A certificate must carry the name its callers dial,
a DNS name or IP address in its subjectAltName, with two cases where that name is not the target's host,
both set with gRPC's `grpc.ssl_target_name_override` (and nothing else uses it):
- replicas found through a `dns:///name:port` target are dialled by the addresses the name resolves to
  (common/discovery.py places requests on them itself); their certificates are checked against `name`,
  as gRPC checks a `dns:///` target it resolves itself (`open_channel(server_name=name)`);
- a `unix:` socket target is checked against `localhost` (gRPC would check the socket's path, which no
  certificate carries).
The files are read when a server binds or a channel opens, so a channel opened after a certificate was
renewed uses the new one.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

ChannelOptions = Sequence[tuple[str, int | str]]


@dataclass(frozen=True)
class TlsFiles:
    """One endpoint's PEM files; which are given decides what TLS does (see the module docstring)."""

    cert_file: str = ""
    """Certificate (chain) this end presents: a server's, or a channel's client certificate."""
    key_file: str = ""
    """Private key of cert_file (unencrypted PEM)."""
    ca_file: str = ""
    """CA bundle the other end's certificate must be signed by: clients' for a server (mutual TLS), the
    server's for a channel."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a TLS certificate needs its key and a key its certificate")

    @property
    def is_enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)

    def check(self) -> None:
        """ValueError naming the file when one cannot be read, is not PEM, or the key is not the certificate's;
        for a clear error at start-up rather than at the first connection."""
        if self.cert_file:
            check_key_pair(self.cert_file, self.key_file)
        if self.ca_file:
            _read_ca(self.ca_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        return server_credentials(self.cert_file, self.key_file, self.ca_file or None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file or None, self.cert_file or None, self.key_file or None)


@dataclass
class InternalTlsFields:
    """The internal hops' mutual TLS: fields every service's config has (it derives from this class)."""

    internal_tls_cert_file: str = ""
    """PEM certificate this service presents on the internal hops. It shows it as a server to its callers and as a
    client to the services it dials; with internal_tls_key_file and internal_tls_ca_file it turns on mutual TLS
    (all three empty = plaintext)."""
    internal_tls_key_file: str = ""
    """PEM private key of internal_tls_cert_file."""
    internal_tls_ca_file: str = ""
    """PEM CA bundle that signs this service's peers. A caller must present a certificate it signed, and so must a
    service this one dials."""


INTERNAL_FIELDS = tuple(field.name for field in fields(InternalTlsFields))
"""InternalTlsFields' fields, in order: certificate, key, CA."""


def internal_tls(config: object) -> TlsFiles | None:
    """The internal hops' mutual TLS of a service's config (its INTERNAL_FIELDS): all three files, or None
    (plaintext) when none is given; ValueError naming the fields when only some are."""
    files = [getattr(config, name) for name in INTERNAL_FIELDS]
    if not any(files):
        return None
    if not all(files):
        missing = ", ".join(name for name, path in zip(INTERNAL_FIELDS, files) if not path)
        raise ValueError(f"mutual TLS of the internal hops needs {', '.join(INTERNAL_FIELDS)} together; "
                         f"missing: {missing}")
    return TlsFiles(*files)


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; ValueError saying which file (`what`) could not be read or is not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the TLS {what} {path!r} is not a PEM file")
    return data


def check_key_pair(cert_file: str, key_file: str) -> None:
    """ValueError unless the certificate and its key load together (PEM, unencrypted, matching)."""
    read_pem(cert_file, "certificate")
    read_pem(key_file, "key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except ssl.SSLError as exc:
        raise ValueError(f"the TLS certificate {cert_file!r} and key {key_file!r} do not load together: "
                         f"{exc.reason or exc}") from None


def _read_ca(ca_file: str) -> bytes:
    data = read_pem(ca_file, "CA file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii", errors="replace"))
    except ssl.SSLError as exc:
        raise ValueError(f"the TLS CA file {ca_file!r} holds no usable certificate: {exc.reason or exc}") from None
    return data


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """A server's certificate and key; with `client_ca_file`, clients must present a certificate it signed."""
    check_key_pair(cert_file, key_file)
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    if client_ca_file is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=_read_ca(client_ca_file), require_client_auth=True)


def channel_credentials(ca_file: str | None, cert_file: str | None = None,
                        key_file: str | None = None) -> grpc.ChannelCredentials:
    """A channel verifying the server against `ca_file` (None = the system's roots), presenting
    `cert_file`/`key_file` as its client certificate when given."""
    root = _read_ca(ca_file) if ca_file else None
    if not cert_file and not key_file:
        return grpc.ssl_channel_credentials(root_certificates=root)
    if not (cert_file and key_file):
        raise ValueError("a TLS client certificate needs its key and a key its certificate")
    check_key_pair(cert_file, key_file)
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=Path(key_file).read_bytes(),
                                        certificate_chain=Path(cert_file).read_bytes())


EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
"""Server option for every segserve gRPC server: bind without SO_REUSEPORT (gRPC's default on Linux), so a second
server on a port another one holds fails to start, instead of sharing that port's connections with it (a
scheduler's calls would then land on two workers by turns)."""


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Bind `address` on `server`, over TLS when `tls` is given (and enabled), else plaintext; returns the
    port bound, 0 when it could not bind (grpc returns 0 or raises, by version)."""
    try:
        if tls is None or not tls.is_enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:
        return 0


UNIX_SERVER_NAME = "localhost"
"""The name a `unix:` target's certificate is checked against."""


RECONNECT_OPTIONS: ChannelOptions = (("grpc.initial_reconnect_backoff_ms", 100),
                                     ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000))
"""Every internal channel dials a peer it lost again within a second (gRPC's default backs off to two minutes):
a restarted service (a supervisor's or a pod's restart) is taken back into use at once."""


def _options(address: str, options: ChannelOptions, server_name: str | None) -> list[tuple[str, int | str]]:
    options = [*RECONNECT_OPTIONS, *options]
    if server_name is None and address.startswith(("unix:", "unix-abstract:")):
        server_name = UNIX_SERVER_NAME
    return [*options, ("grpc.ssl_target_name_override", server_name)] if server_name else options


def open_channel(address: str, tls: TlsFiles | None, options: ChannelOptions = (),
                 server_name: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`, over TLS when `tls` is given (and enabled). `server_name`: the name the
    server's certificate must carry when it is not the address's host (a replica a DNS name resolved to)."""
    if tls is None or not tls.is_enabled:
        return grpc.aio.insecure_channel(address, options=[*RECONNECT_OPTIONS, *options])
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_options(address, options, server_name))


def open_blocking_channel(address: str, tls: TlsFiles | None, options: ChannelOptions = (),
                          server_name: str | None = None) -> grpc.Channel:
    """`open_channel` for blocking (non-asyncio) callers."""
    if tls is None or not tls.is_enabled:
        return grpc.insecure_channel(address, options=[*RECONNECT_OPTIONS, *options])
    return grpc.secure_channel(address, tls.channel_credentials(), options=_options(address, options, server_name))
