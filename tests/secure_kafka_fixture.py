"""A secured Kafka broker for the tests that need one: SASL_SSL with SCRAM-SHA-512, TLS verified, ACLs.

The module fixture ``secure_kafka`` starts it with ``scripts/kafka-broker start --secure`` in a private
state dir (so CI needs nothing prepared), and stops and deletes it after the module. Its three users are
``admin`` (a super user), ``writer`` and ``trainer``, which get only the ACLs a test grants them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kafka_broker_fixture import load_broker_module


@dataclass
class SecureKafka:
    """Where the secured broker listens, the CA that signed its certificate and its users' passwords."""

    bootstrap: str
    ca_location: str
    passwords: dict[str, str]
    state_dir: Path
    topics: list[str] = field(default_factory=list)

    def config(
        self, user: str, *, password: str | None = None, ca_location: str | None = None
    ) -> dict[str, str]:
        """librdkafka settings for ``user``: SASL_SSL, SCRAM-SHA-512, the broker's CA, hostname checked."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": user,
            "sasl.password": self.passwords[user] if password is None else password,
            "ssl.ca.location": ca_location or self.ca_location,
            "ssl.endpoint.identification.algorithm": "https",
        }

    def options(self, user: str, **overrides: Any) -> list[str]:
        """The same settings as ``-X KEY=VALUE`` arguments of the ``tokcap`` command."""
        arguments: list[str] = []
        for key, value in self.config(user, **overrides).items():
            arguments += ["-X", f"{key}={value}"]
        return arguments

    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({**self.config("admin"), "bootstrap.servers": self.bootstrap})

    def new_run(self) -> str:
        """A run id whose topic is deleted at the end of the session."""
        run = f"sec-{uuid.uuid4().hex[:12]}"
        self.topics.extend([f"tokcap.{run}", f"tokcap-staged.tokcap.{run}"])
        return run

    def grant(self, user: str, topic: str, operations: tuple[str, ...]) -> None:
        """Allow ``user`` these operations on ``topic`` only (and reading groups named ``tokcap-*``)."""
        from confluent_kafka.admin import (
            AclBinding,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
            ResourceType,
        )

        principal = f"User:{user}"
        bindings = [
            AclBinding(
                ResourceType.TOPIC,
                topic,
                ResourcePatternType.LITERAL,
                principal,
                "*",
                getattr(AclOperation, operation),
                AclPermissionType.ALLOW,
            )
            for operation in operations
        ]
        if "READ" in operations:
            bindings.append(
                AclBinding(
                    ResourceType.GROUP,
                    "tokcap-",
                    ResourcePatternType.PREFIXED,
                    principal,
                    "*",
                    AclOperation.READ,
                    AclPermissionType.ALLOW,
                )
            )
        admin = self.admin()  # kept alive until the futures resolve
        for future in admin.create_acls(bindings, request_timeout=30).values():
            future.result(timeout=30)

    def revoke(self, user: str, topic: str, operation: str) -> None:
        """Take back one operation granted to ``user`` on ``topic``."""
        from confluent_kafka.admin import (
            AclBindingFilter,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
            ResourceType,
        )

        binding = AclBindingFilter(
            ResourceType.TOPIC,
            topic,
            ResourcePatternType.LITERAL,
            f"User:{user}",
            "*",
            getattr(AclOperation, operation),
            AclPermissionType.ALLOW,
        )
        admin = self.admin()
        for future in admin.delete_acls([binding], request_timeout=30).values():
            assert future.result(timeout=30), f"no {operation} ACL of {user} on {topic} to revoke"

    def set_password(self, user: str, password: str) -> None:
        """Rotate ``user``'s SCRAM credential on the broker (``passwords`` keeps the original)."""
        from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

        upsertion = UserScramCredentialUpsertion(
            user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode()
        )
        admin = self.admin()
        for future in admin.alter_user_scram_credentials([upsertion], request_timeout=30).values():
            future.result(timeout=30)


@pytest.fixture(scope="module")
def secure_kafka() -> Iterator[SecureKafka]:
    """A secured broker for one test module, started here and stopped after the module's last test."""
    module = load_broker_module()
    root = Path(module.default_state_dir())
    module.prune_orphans(root)
    state_dir = root / f"secure-{os.getpid()}"
    try:
        bootstrap = str(module.start(state_dir, owner_pid=os.getpid(), secure=True))
    except Exception as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        pytest.fail(f"the secured Kafka broker could not be started: {exc}")
    security = module.read_security(state_dir)
    broker = SecureKafka(
        bootstrap=bootstrap,
        ca_location=str(security["ca_location"]),
        passwords=dict(security["users"]),
        state_dir=state_dir,
    )
    try:
        yield broker
    finally:
        module.stop(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
