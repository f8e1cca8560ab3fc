"""Who a peer is: node ids bound to TLS certificates.

The rule (docs/cluster.md, "Transport"): a node's certificate, issued by the
mesh's CA (``peers.ca_file``), carries exactly one URI SAN
``spiffe://<trust domain>/node/<id>``; that ``<id>`` is the node id.

* Incoming: gRPC verifies the client certificate against the CA
  (``require_client_auth``); the id comes from the connection's
  ``peer_spiffe_id`` (gRPC sets it only for exactly one valid SPIFFE URI SAN)
  and must equal the ``sender`` of every packet on that connection.
* Outgoing: a channel to node ``<id>`` verifies the server certificate against
  the CA and for the host name ``<id>`` (``grpc.ssl_target_name_override``):
  standard host name verification, satisfied by a DNS SAN ``<id>`` or, when the
  certificate has no DNS SAN, a CN ``<id>``.  A seed, whose id is not known yet,
  is identified first by one TLS handshake (:func:`identify`).

Node ids are DNS-1123 subdomains (Kubernetes node names are): lower-case
letters, digits, ``-`` and ``.``, at most 253 characters.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmmesh.net import parse_hostport
from qosd.mesh.membership.core import ClusterError

if TYPE_CHECKING:
    import grpc

__all__ = ["Credentials", "PeersError", "identify", "load_credentials", "node_of_uri",
           "peer_node", "spiffe_id", "valid_node_id"]

_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_NODE_ID = re.compile(rf"{_LABEL}(\.{_LABEL})*")
EXPIRY_WARNING = datetime.timedelta(days=14)


class PeersError(ClusterError):
    """The peers' configuration or credentials cannot work (qosd does not start them)."""


def valid_node_id(node: str) -> bool:
    """Whether ``node`` is a DNS-1123 subdomain (a node id the rule accepts)."""
    return len(node) <= 253 and _NODE_ID.fullmatch(node) is not None


def spiffe_id(node: str, trust_domain: str) -> str:
    """The URI SAN that names ``node``: ``spiffe://<trust_domain>/node/<node>``."""
    return f"spiffe://{trust_domain}/node/{node}"


def node_of_uri(uri: str, trust_domain: str) -> str | None:
    """The node id in a URI SAN of the rule's form, or None."""
    prefix = f"spiffe://{trust_domain}/node/"
    if not uri.startswith(prefix):
        return None
    node = uri[len(prefix):]
    return node if valid_node_id(node) else None


def peer_node(auth: Mapping[str, Iterable[bytes]], trust_domain: str) -> str | None:
    """The node id of an authenticated gRPC peer (``context.auth_context()``), or None."""
    ids = list(auth.get("peer_spiffe_id") or ())
    if len(ids) != 1:
        return None
    return node_of_uri(ids[0].decode("ascii", "replace"), trust_domain)


def _uri_sans(cert: object) -> list[str]:
    from cryptography import x509

    assert isinstance(cert, x509.Certificate)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


@dataclass(frozen=True)
class Credentials:
    """This node's certificate chain, key and the mesh CA, as PEM bytes, and
    the node id its certificate names."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    node: str
    not_after: datetime.datetime
    cert_file: Path
    key_file: Path
    ca_file: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials: our certificate, and client certificates required."""
        import grpc

        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)],
                                           root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: the CA, and our certificate as the client's."""
        import grpc

        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context for :func:`identify` (CA-verified, no host name check)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(cadata=self.ca_pem.decode())
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        ctx.set_alpn_protocols(["h2"])
        return ctx


def load_credentials(cert_file: Path, key_file: Path, ca_file: Path, trust_domain: str,
                     node: str) -> Credentials:
    """Reads and checks the files: the certificate names ``node`` by the rule,
    was issued by the CA, is valid now, and matches the key.  Raises
    :class:`PeersError` saying what is wrong."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        cert_pem, key_pem, ca_pem = (Path(p).read_bytes() for p in (cert_file, key_file, ca_file))
    except OSError as e:
        raise PeersError(f"peers: cannot read {e.filename}: {e.strerror}") from e
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cas = x509.load_pem_x509_certificates(ca_pem)
        key = load_pem_private_key(key_pem, password=None)
    except ValueError as e:
        raise PeersError(f"peers: unreadable certificate, key or CA: {e}") from e
    uris = _uri_sans(cert)
    ids = [n for n in (node_of_uri(u, trust_domain) for u in uris) if n]
    if len(uris) != 1 or len(ids) != 1:
        raise PeersError(f"peers: {cert_file} must carry exactly one URI SAN "
                         f"{spiffe_id('<node>', trust_domain)} (it has {uris or 'none'})")
    if ids[0] != node:
        raise PeersError(f"peers: {cert_file} is the certificate of node {ids[0]!r}, "
                         f"but this node is {node!r} (node_name)")
    if key.public_key() != cert.public_key():
        raise PeersError(f"peers: {key_file} is not the key of {cert_file}")
    if not any(_issued_by(cert, ca) for ca in cas):
        raise PeersError(f"peers: {cert_file} was not issued by a CA in {ca_file}")
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise PeersError(f"peers: {cert_file} is not valid now (valid "
                         f"{cert.not_valid_before_utc:%Y-%m-%d} to "
                         f"{cert.not_valid_after_utc:%Y-%m-%d})")
    return Credentials(cert_pem, key_pem, ca_pem, node, cert.not_valid_after_utc,
                       Path(cert_file), Path(key_file), Path(ca_file))


def _issued_by(cert: object, ca: object) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(ca)  # type: ignore[attr-defined]
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


async def identify(addr: str, ctx: ssl.SSLContext, trust_domain: str,
                   timeout: float) -> str | None:
    """The node id of the peer at ``addr`` from its certificate (one TLS
    handshake, verified against the CA), or None when it cannot be reached or
    its certificate names no node."""
    host, port = parse_hostport(addr, what="peer address")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=None), timeout)
    except (TimeoutError, OSError, ssl.SSLError):
        return None
    try:
        cert = writer.get_extra_info("peercert") or {}
        uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]
    finally:
        with contextlib.suppress(Exception):
            writer.transport.abort()  # no TLS close: the server talks HTTP/2 at once
    return node_of_uri(uris[0], trust_domain) if len(uris) == 1 else None
