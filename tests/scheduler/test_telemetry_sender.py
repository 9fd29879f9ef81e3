"""A telemetry report is believed only from its own subject, by scheduler and gateway."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from common.errors import ProtocolError
from common.protocol import Telemetry
from common.subjects import Subjects, read_telemetry
from tests.scheduler.conftest import hand_driven, make_config

SUBJECTS = Subjects("qos")


def report(worker: str = "w1", group: str = "short") -> bytes:
    return Telemetry(worker=worker, group=group, ts_ms=0).to_bytes()


def test_a_report_is_read_from_its_own_subject_only() -> None:
    assert read_telemetry("qos.tel.short.w1", report(), SUBJECTS).worker == "w1"
    with pytest.raises(
        ProtocolError, match=r"from qos\.tel\.short\.w2 sent on qos\.tel\.short\.w1"
    ):
        read_telemetry("qos.tel.short.w1", report("w2"), SUBJECTS)
    with pytest.raises(ProtocolError, match=r"sent on qos\.tel\.long\.w1"):
        read_telemetry("qos.tel.long.w1", report(), SUBJECTS)  # another group's subject


def test_an_id_that_is_no_subject_token_is_refused() -> None:
    for worker in ("a.b", "*", ">", "", "a b"):
        with pytest.raises(ProtocolError, match="not a valid subject token"):
            read_telemetry("qos.tel.short.x", report(worker), SUBJECTS)


async def test_the_scheduler_takes_no_worker_from_a_report_on_anothers_subject(nats_config):
    """A worker id like ``a.b`` made the control subject raise in every tick's reconcile
    and every rebalance that picked it (the round ended there, the same pair won again)."""
    async with hand_driven(make_config(nats_config)) as (service, _):
        for data in (report("a.b"), report("w9"), report()):
            subject = service.subjects.telemetry("short", "w1")
            msg = Msg(_client=None, subject=subject, data=data)  # type: ignore[arg-type]
            await service._on_telemetry(msg)
        assert service.windows.worker_ids() == {"w1"}


async def test_a_worker_built_at_the_open_cap_is_not_told_to_leave_it_every_two_seconds(
    nats_config,
):
    """Started with --max-batch 4 in a group of 8 whose open cap is 4, it reported the open
    cap while the breaker was closed: told to raise it every 2 s, for ever (each order also
    reset its cap's clock and woke its loop). Two tries, then it is the engine's limit."""
    async with hand_driven(make_config(nats_config)) as (service, now):
        sent: list[tuple[str, object]] = []

        async def publish(subject: str, message: object) -> None:
            sent.append((subject, message))

        service._publish = publish  # type: ignore[method-assign]
        for _ in range(6):
            now[0] += 2.5
            beat = Telemetry(worker="small", group="short", ts_ms=0, batch_cap=4)
            service.windows.observe(beat, now[0])
            await service._reconcile_caps(now[0])
        assert len(sent) == 2
        # Asked again once the breaker has been open (where the cap is right) and closed.
        for state in ("open", "closed"):
            service.breakers["short"].state = state
            now[0] += 2.5
            service.windows.observe(beat, now[0])
            await service._reconcile_caps(now[0])
        assert len(sent) == 3
