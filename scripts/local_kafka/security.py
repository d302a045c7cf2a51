"""A secured broker's security: a throwaway CA and broker certificate, SCRAM users, and the SASL_SSL settings.

``start --secure`` makes the broker listen on one SASL_SSL listener (SCRAM-SHA-512) with a throwaway CA and
broker certificate made with openssl, the StandardAuthorizer (ACLs, nothing allowed unless granted) and three
SCRAM users written into the storage at format time. ``security.json`` in the state dir then names the CA
file and the users' passwords for tests and local runs.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from pathlib import Path

from .errors import BrokerError

SECURITY_FILE = "security.json"
TLS_DIR = "tls"
SCRAM_MECHANISM = "SCRAM-SHA-512"
SECURE_USERS = ("admin", "writer", "trainer")
"""SCRAM users of a secured broker: ``admin`` is a super user; the others get only the ACLs a test grants."""


def _openssl(*args: str, cwd: Path) -> None:
    try:
        proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BrokerError(f"cannot run openssl (needed for --secure): {exc}") from exc
    if proc.returncode != 0:
        raise BrokerError(f"openssl {args[0]} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def make_certificates(directory: Path, keystore_password: str) -> None:
    """A throwaway CA and a broker certificate for 127.0.0.1/localhost signed by it, as a PKCS12 keystore.

    Everything lives two days: it only has to outlast one test session.
    """
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=tokcap throwaway test CA", cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
        "-subj", "/CN=localhost", cwd=directory,
    )  # fmt: skip
    (directory / "broker.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "broker.pem", "-days", "2", "-extfile", "broker.ext", cwd=directory,
    )  # fmt: skip
    _openssl(
        "pkcs12", "-export", "-in", "broker.pem", "-inkey", "broker.key", "-certfile", "ca.pem",
        "-name", "broker", "-out", "broker.p12", "-passout", f"pass:{keystore_password}", cwd=directory,
    )  # fmt: skip


def new_security(state_dir: Path) -> dict[str, object]:
    """Fresh certificates and passwords for a secured broker, recorded in ``security.json``."""
    tls = state_dir / TLS_DIR
    shutil.rmtree(tls, ignore_errors=True)
    keystore_password = secrets.token_urlsafe(16)
    make_certificates(tls, keystore_password)
    security: dict[str, object] = {
        "mechanism": SCRAM_MECHANISM,
        "ca_location": str(tls / "ca.pem"),
        "keystore_location": str(tls / "broker.p12"),
        "keystore_password": keystore_password,
        "users": {name: secrets.token_urlsafe(16) for name in SECURE_USERS},
    }
    path = state_dir / SECURITY_FILE
    path.write_text(json.dumps(security, indent=2) + "\n")
    path.chmod(0o600)
    return security


def read_security(state_dir: Path) -> dict[str, object] | None:
    """The CA file and users of a secured broker's state dir, or None for a plain broker."""
    try:
        loaded = json.loads((state_dir / SECURITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


REAUTHENTICATE_MS = 4000
"""How long a secured broker's SASL session lasts before the client must log in again."""


def secure_properties(props: dict[str, str], broker_port: int, security: dict[str, object]) -> None:
    """Turn the client listener into SASL_SSL with SCRAM, and deny everything not granted by an ACL."""
    users = security["users"]
    assert isinstance(users, dict)
    jaas = (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
        f'password="{users["admin"]}";'
    )
    props.update(
        {
            "listeners": f"SASL_SSL://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:"
            + props["controller.quorum.voters"].rsplit(":", 1)[1],
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{broker_port}",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(security["keystore_location"]),
            "ssl.keystore.password": str(security["keystore_password"]),
            "ssl.key.password": str(security["keystore_password"]),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(security["ca_location"]),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            # The controller listener is plaintext on loopback; its principal is ANONYMOUS.
            "super.users": "User:admin;User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
            # Sessions re-authenticate every few seconds (KIP-368), so a rotated password or a removed user
            # reaches live connections mid-run, as on a production broker that sets this.
            "connections.max.reauth.ms": str(REAUTHENTICATE_MS),
        }
    )
