"""NATS subject names (DESIGN §2), built in one place from the configured prefix."""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import ProtocolError
from common.protocol import DEFAULT_MAX_PAYLOAD, Telemetry

# Request ids and worker ids become subject tokens: no dots, wildcards or spaces.
# Matched whole (fullmatch): ``$`` also matches before a final newline, which let
# "short\n" through into a subject.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
# A worker's heartbeat key in the state bucket: workers.<worker id>.
HEARTBEAT_KEY_PREFIX = "workers."


def is_subject_token(value: str) -> bool:
    """True when ``value`` can stand as one token of a subject."""
    return _TOKEN.fullmatch(value) is not None


def read_telemetry(
    subject: str, data: bytes, subjects: Subjects, max_bytes: int = DEFAULT_MAX_PAYLOAD
) -> Telemetry:
    """A worker's report, believed only from its own subject (``ProtocolError`` else).

    NATS permissions can bind a worker's credentials to its own telemetry subject: a body
    claiming another worker or group is not taken. This also keeps out ids that are no
    subject token, whose control subject raised in the scheduler's every reconcile and
    every rebalance that picked them.
    """
    report = Telemetry.from_bytes(data, max_bytes)
    try:
        expected = subjects.telemetry(report.group, report.worker)
    except ValueError as exc:
        raise ProtocolError(f"telemetry: {exc}") from None
    if subject != expected:
        raise ProtocolError(f"telemetry: a report from {expected} sent on {subject}")
    return report


@dataclass(frozen=True)
class Subjects:
    prefix: str = "qos"

    def _token(self, value: str, what: str) -> str:
        if not is_subject_token(value):
            raise ValueError(
                f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-]{{1,128}})"
            )
        return value

    def request(self, group: str) -> str:
        return f"{self.prefix}.req.{self._token(group, 'group')}"

    @property
    def request_wildcard(self) -> str:
        return f"{self.prefix}.req.*"

    def out(self, request_id: str) -> str:
        return f"{self.prefix}.out.{self._token(request_id, 'request id')}"

    def resume(self, request_id: str) -> str:
        return f"{self.prefix}.resume.{self._token(request_id, 'request id')}"

    @property
    def resume_wildcard(self) -> str:
        return f"{self.prefix}.resume.*"

    def telemetry(self, group: str, worker_id: str) -> str:
        return (
            f"{self.prefix}.tel.{self._token(group, 'group')}.{self._token(worker_id, 'worker id')}"
        )

    @property
    def telemetry_wildcard(self) -> str:
        return f"{self.prefix}.tel.>"

    def gateway_heartbeat(self, gateway_id: str) -> str:
        return f"{self.prefix}.gw.{self._token(gateway_id, 'gateway id')}"

    @property
    def gateway_heartbeat_wildcard(self) -> str:
        return f"{self.prefix}.gw.*"

    def control(self, worker_id: str) -> str:
        return f"{self.prefix}.ctl.{self._token(worker_id, 'worker id')}"

    def control_group(self, group: str) -> str:
        """The scheduler's commands to every replica of ``group`` (batch caps)."""
        return f"{self.prefix}.ctl.group.{self._token(group, 'group')}"

    def abort(self, group: str) -> str:
        """Callers' aborts of ``group``'s requests: a subject of its own, so that the right
        to abort (gateways, NATS callers) is not the right to command the group."""
        return f"{self.prefix}.abort.{self._token(group, 'group')}"

    @property
    def kv_events(self) -> str:
        return f"{self.prefix}.kv.events"

    @staticmethod
    def consumer(group: str) -> str:
        """The durable pull consumer every replica of ``group`` shares."""
        return f"grp-{group}"
