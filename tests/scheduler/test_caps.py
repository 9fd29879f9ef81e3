"""A worker whose cap disagrees with its group's breaker (a joiner, a restarted replica) is
told the breaker's cap on its own subject, not only at the next group-wide renewal."""

from __future__ import annotations

from common.protocol import Control, Telemetry
from tests.scheduler.conftest import hand_driven, make_config
from tests.scheduler.test_alerts import open_short


def joiner_report(cap: int) -> Telemetry:
    return Telemetry(worker="w9", group="short", ts_ms=0, state="serving", batch_cap=cap,
                     e2e_p99_ms=0.0, samples=0, requests_done=0)  # fmt: skip


async def test_a_replica_joining_an_open_group_is_told_the_open_cap_on_its_own_subject(
    nats_config, monkeypatch
):
    async with hand_driven(make_config(nats_config)) as (service, now):
        await open_short(service, now)
        assert service.breakers["short"].state == "open"
        sent: list[tuple[str, Control]] = []
        real = service._publish

        async def publish(subject: str, control: Control) -> bool:
            sent.append((subject, control))
            return await real(subject, control)

        monkeypatch.setattr(service, "_publish", publish)
        own = service.subjects.control("w9")
        now[0] += 0.5
        service.windows.observe(joiner_report(8), now[0])
        await service.tick()
        assert [(c.action, c.batch_cap) for s, c in sent if s == own] == [("set_batch_cap", 4)]
        # Told once; a report still at the old cap within the resend pause is not told again.
        now[0] += 0.5
        service.windows.observe(joiner_report(8), now[0])
        await service.tick()
        assert len([s for s, _ in sent if s == own]) == 1
        # Heeded: nothing more for it, however long it stays.
        now[0] += 3.0
        service.windows.observe(joiner_report(4), now[0])
        await service.tick()
        assert len([s for s, _ in sent if s == own]) == 1
