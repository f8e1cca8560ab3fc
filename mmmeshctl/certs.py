"""Certificates for test and lab meshes: a CA and one certificate and key per node.

Each node certificate carries what qosd's identity rule expects
(qosd/mesh/membership/_identity.py): the URI SAN ``spiffe://<trust domain>/node/<id>``
(the identity), and the DNS SAN and CN ``<id>`` (what a connecting peer checks
as the server name); it is valid for TLS server and client use.  Keys are
ECDSA P-256; every file is written 0600.  ``mmmeshctl cluster certs`` and the
tests' mesh use it; production certificates come from the operator's own CA
(docs/operations.md, "Peers").
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

__all__ = ["issue_certs"]


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def issue_certs(out: Path, nodes: list[str], *, trust_domain: str = "mmmesh", days: int = 365,
                force: bool = False, ca_name: str = "mmmesh lab CA") -> list[Path]:
    """Writes ``ca.pem``, ``ca.key`` and ``<node>.pem`` / ``<node>.key`` for each
    node into ``out`` (all 0600); returns the paths written.  Without ``force``,
    raises FileExistsError (before writing anything) when one of them exists."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def usage(ca: bool) -> x509.KeyUsage:
        return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca,
                             content_commitment=False, key_encipherment=False,
                             data_encipherment=False, key_agreement=False,
                             encipher_only=False, decipher_only=False)

    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    until = now + datetime.timedelta(days=days)
    targets = [out / n for n in ("ca.pem", "ca.key")] + [
        out / f"{node}{ext}" for node in nodes for ext in (".pem", ".key")]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} exist(s) (--force replaces them)")
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca = (x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    written = [out / "ca.pem", out / "ca.key"]
    _write(written[0], ca.public_bytes(serialization.Encoding.PEM))
    _write(written[1], pem_key(ca_key))
    for node in nodes:
        key = ec.generate_private_key(ec.SECP256R1())
        san = x509.SubjectAlternativeName([
            x509.UniformResourceIdentifier(f"spiffe://{trust_domain}/node/{node}"),
            x509.DNSName(node)])
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
                .issuer_name(ca_subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(until)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(usage(False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(san, critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        pair = [out / f"{node}.pem", out / f"{node}.key"]
        _write(pair[0], cert.public_bytes(serialization.Encoding.PEM))
        _write(pair[1], pem_key(key))
        written += pair
    return written
