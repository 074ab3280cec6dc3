"""Test certificates made on the fly with `cryptography`: a CA, certificates it signs, PEM files on disk."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key as PEM files."""

    cert_file: str
    key_file: str


class CertificateAuthority:
    """A self-signed CA whose certificates are written under `directory` as <name>.pem / <name>.key."""

    def __init__(self, directory: Path, name: str = "segserve-test-ca"):
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _VALID).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self.key, hashes.SHA256()))
        self.ca_file = str(directory / f"{name}.pem")
        Path(self.ca_file).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, dns_names: tuple[str, ...] = ("localhost",),
              ip_addresses: tuple[str, ...] = ("127.0.0.1",), is_server: bool = True) -> Issued:
        """A certificate for `name` with these subjectAltNames, for client auth (and server auth with is_server)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if is_server else [])
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _VALID).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        alt_names = [x509.DNSName(d) for d in dns_names] + [x509.IPAddress(ipaddress.ip_address(i))
                                                            for i in ip_addresses]
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        issued = Issued(str(self.directory / f"{name}.pem"), str(self.directory / f"{name}.key"))
        Path(issued.cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        Path(issued.key_file).write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
        return issued
