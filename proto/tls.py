"""Optional TLS and mutual TLS for every server and client of a process: one frozen config, one set of flags.

gRPC takes ``server_credentials``/``channel_credentials`` (or ``add_port``/``channel``/``aio_channel``); the
router's OpenAI HTTP front, every ``/metrics`` endpoint and plain sockets take ``ssl_server_context`` /
``ssl_client_context``, built here from the same files with the same rule: a CA set -> client certificates
required (mTLS).

    --tls-cert PEM   this process's certificate (chain); a server presents it, a client presents it for mTLS
    --tls-key PEM    its private key (with --tls-cert, never alone)
    --tls-ca PEM     the CA bundle this process trusts: a server then requires and verifies client
                     certificates (mTLS); a client verifies servers against it instead of the system roots
    --tls-server-name NAME   the name servers' certificates carry when it differs from the dialled host

Environment defaults: ``BATON_TLS_CERT``, ``BATON_TLS_KEY``, ``BATON_TLS_CA``, ``BATON_TLS_SERVER_NAME``.
None of them set: plaintext, exactly as before. Files are checked when the config is built (present,
readable, PEM that OpenSSL parses, key matching the certificate), so a typo fails at start, not at the first
handshake; they are read again when credentials are made (a restart picks up renewed certificates).
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ENV_CERT, ENV_KEY, ENV_CA, ENV_SERVER_NAME = "BATON_TLS_CERT", "BATON_TLS_KEY", "BATON_TLS_CA", "BATON_TLS_SERVER_NAME"
ChannelOptions = Sequence[tuple[str, Any]]
# Channels between Baton's own processes (router -> worker, decode worker -> KV holder): one connection attempt
# gives up after PEER_CONNECT_TIMEOUT_S (gRPC's own default waits 20 s on an address that never answers, e.g.
# one a worker advertises that this host cannot reach), and an RPC waiting on it fails UNAVAILABLE then. A
# connection whose peer vanished without a word (its link down, its host gone: no FIN, no RST) is found by HTTP/2
# keepalive pings: while calls are open the caller pings after PEER_KEEPALIVE_S without news and gives up
# PEER_KEEPALIVE_TIMEOUT_S later (its calls fail UNAVAILABLE) instead of waiting for the request's deadline (a
# streaming Decode sends nothing after its request: pings without data must not be capped). Workers accept pings
# that often (PEER_SERVER_OPTIONS; gRPC's default answers a ping more often than every 5 minutes with GOAWAY) and
# ping their callers in turn, so a call whose caller vanished is cancelled and frees its blocks.
PEER_CONNECT_TIMEOUT_S = 2.0
PEER_KEEPALIVE_S = 5.0
PEER_KEEPALIVE_TIMEOUT_S = 5.0
PEER_CHANNEL_OPTIONS: ChannelOptions = (
    ("grpc.min_reconnect_backoff_ms", int(PEER_CONNECT_TIMEOUT_S * 1000)),
    # a channel that failed to connect fails its calls at once until its next attempt: a worker restarted at the
    # same address is tried again within 5 s (gRPC's backoff grows to 120 s)
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.keepalive_time_ms", int(PEER_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PEER_KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.max_pings_without_data", 0),
)
PEER_SERVER_OPTIONS: ChannelOptions = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(PEER_KEEPALIVE_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", int(2 * PEER_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PEER_KEEPALIVE_TIMEOUT_S * 1000)),
)


class TlsConfigError(ValueError):
    """A TLS flag names a missing, unreadable or malformed file, or flags that do not go together."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    cert: Path | None = None  # PEM certificate chain, leaf first
    key: Path | None = None  # PEM private key of ``cert``
    ca: Path | None = None  # PEM CA bundle: verify peers against it; a server requires client certificates
    server_name: str | None = None  # expected name in servers' certificates (None: the dialled host)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, missing = ("--tls-key", "--tls-cert") if self.cert is None else ("--tls-cert", "--tls-key")
            raise TlsConfigError(f"{given} needs {missing} too (a certificate and its private key go together)")
        if self.server_name is not None and not self.enabled:
            raise TlsConfigError("--tls-server-name needs TLS: give --tls-ca (and/or --tls-cert/--tls-key)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None:
                _check_readable(flag, path)
        _check_pem(self)

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    @property
    def mutual(self) -> bool:
        """A server built from this config requires client certificates signed by ``ca``."""
        return self.ca is not None

    def require_server_identity(self) -> None:
        """Raise unless a server can be built from this config (servers need a certificate and key)."""
        if self.cert is None:
            raise TlsConfigError("--tls-ca alone configures a client: a server also needs --tls-cert and --tls-key")

    @classmethod
    def from_values(cls, cert: str | None, key: str | None, ca: str | None,
                    server_name: str | None = None) -> TlsConfig | None:
        """None when nothing is set (plaintext); empty strings count as unset."""
        if not (cert or key or ca or server_name):
            return None
        return cls(cert=Path(cert) if cert else None, key=Path(key) if key else None,
                   ca=Path(ca) if ca else None, server_name=server_name or None)


def _check_readable(flag: str, path: Path) -> None:
    if not path.is_file():
        raise TlsConfigError(f"{flag} {path}: no such file")
    try:
        with path.open("rb") as f:
            head = f.read(1 << 20)
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc
    if b"-----BEGIN " not in head:
        raise TlsConfigError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")


def _check_pem(config: TlsConfig) -> None:
    """Let OpenSSL parse the files: a bad certificate, a key that does not match it, a bad CA bundle."""
    if config.cert is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(config.cert, config.key)
        except ssl.SSLError as exc:
            raise TlsConfigError(f"--tls-cert {config.cert} / --tls-key {config.key}: {_reason(exc)}") from exc
    if config.ca is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=config.ca)
        except ssl.SSLError as exc:
            raise TlsConfigError(f"--tls-ca {config.ca}: not a usable CA bundle ({_reason(exc)})") from exc


def _reason(exc: ssl.SSLError) -> str:
    if exc.reason == "KEY_VALUES_MISMATCH":
        return "the private key does not match the certificate"
    if "PEM lib" in str(exc):
        return "OpenSSL cannot parse the certificate chain or the private key (PEM lib)"
    return exc.reason or str(exc)


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """TLS with ``config.cert``/``key``; with ``config.ca`` clients must present a certificate it signed."""
    config.require_server_identity()
    return grpc.ssl_server_credentials(
        [(_read(config.key), _read(config.cert))], root_certificates=_read(config.ca),
        require_client_auth=config.mutual,
    )


def add_port(server: grpc.Server | grpc.aio.Server, address: str, config: TlsConfig | None) -> int:
    """Bind ``address`` over TLS when ``config`` is set, in plaintext otherwise; returns the bound port."""
    if config is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(config))


def describe(config: TlsConfig | None) -> str:
    """For logs: plaintext, TLS or mTLS."""
    if config is None or not config.enabled:
        return "plaintext"
    return "mTLS" if config.mutual else "TLS"


def channel_credentials(config: TlsConfig) -> grpc.ChannelCredentials:
    """Verify the server against ``config.ca`` (else the system roots); present ``cert``/``key`` when set."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.ca), private_key=_read(config.key), certificate_chain=_read(config.cert),
    )


def _options(config: TlsConfig, options: ChannelOptions) -> list[tuple[str, Any]]:
    extra = [("grpc.ssl_target_name_override", config.server_name)] if config.server_name else []
    return [*options, *extra]


def channel(address: str, config: TlsConfig | None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel: secure when ``config`` enables TLS, plaintext otherwise."""
    if config is None or not config.enabled:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(config), options=_options(config, options))


def aio_channel(address: str, config: TlsConfig | None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An asyncio channel: secure when ``config`` enables TLS, plaintext otherwise."""
    if config is None or not config.enabled:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(config), options=_options(config, options))


# ---- the same files for HTTP (OpenAI front, /metrics) and plain sockets -----------------------------

def ssl_server_context(config: TlsConfig) -> ssl.SSLContext:
    """A stdlib server context with the same semantics: ``ca`` set -> client certificates required."""
    config.require_server_identity()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.cert, config.key)
    if config.ca is not None:
        context.load_verify_locations(cafile=config.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def ssl_client_context(config: TlsConfig) -> ssl.SSLContext:
    """A stdlib client context: verify the server against ``ca`` (else the system roots), present ``cert``.
    Pass ``server_hostname=config.server_name or host`` when wrapping."""
    context = ssl.create_default_context(cafile=config.ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if config.cert is not None:
        context.load_cert_chain(config.cert, config.key)
    return context


# ---- flags (called from the CLIs' main only) ------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    group = parser.add_argument_group("TLS for gRPC, the HTTP front and /metrics (off unless set; see "
                                      "docs/operations.md, Security)")
    group.add_argument("--tls-cert", default=env.get(ENV_CERT) or None, metavar="PEM",
                       help=f"certificate chain this process presents (default: ${ENV_CERT})")
    group.add_argument("--tls-key", default=env.get(ENV_KEY) or None, metavar="PEM",
                       help=f"private key of --tls-cert (default: ${ENV_KEY})")
    group.add_argument("--tls-ca", default=env.get(ENV_CA) or None, metavar="PEM",
                       help="CA bundle to verify peers with; a server then requires client certificates "
                       f"(mTLS) (default: ${ENV_CA})")
    group.add_argument("--tls-server-name", default=env.get(ENV_SERVER_NAME) or None, metavar="NAME",
                       help="name the servers' certificates carry when it differs from the host dialled "
                       f"(default: ${ENV_SERVER_NAME})")


def from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The config the flags of ``add_arguments`` describe; None: plaintext. Raises TlsConfigError."""
    return TlsConfig.from_values(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def from_args_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsConfig | None:
    """``from_args``, a bad flag reported by ``parser.error`` (a usage message and exit status 2)."""
    try:
        return from_args(args)
    except TlsConfigError as exc:
        parser.error(str(exc))
