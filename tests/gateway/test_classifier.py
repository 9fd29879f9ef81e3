"""Classification: explicit group by path or header, else by length; realtime only on request."""

from __future__ import annotations

import httpx
import pytest

from common.config import Config, NatsConfig, default_groups
from common.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from gateway.classifier import classify
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import running_worker

CONFIG = Config()  # realtime 1k (batch 1), short 4k, long 128k; default_max_tokens 256


def test_length_routing_picks_the_smallest_batched_group_that_fits():
    assert classify(CONFIG, prompt_tokens=100, max_tokens=100).group == "short"
    assert classify(CONFIG, prompt_tokens=4000, max_tokens=96).group == "short"
    assert classify(CONFIG, prompt_tokens=4000, max_tokens=97).group == "long"


def test_realtime_is_only_chosen_explicitly():
    routed = classify(CONFIG, prompt_tokens=5, max_tokens=5)
    assert (routed.group, routed.source) == ("short", "length")
    by_path = classify(CONFIG, prompt_tokens=5, max_tokens=5, path_group="realtime")
    assert (by_path.group, by_path.source) == ("realtime", "path")
    by_header = classify(CONFIG, prompt_tokens=5, max_tokens=5, header_group=" realtime ")
    assert (by_header.group, by_header.source) == ("realtime", "header")


def test_batch_one_groups_are_candidates_when_every_group_is_batch_one():
    groups = {
        name: g.model_copy(update={"max_batch": 1, "fallback": None})
        for name, g in default_groups().items()
    }
    assert classify(Config(groups=groups), prompt_tokens=5, max_tokens=5).group == "realtime"


def test_missing_max_tokens_takes_the_default_or_what_is_left():
    assert classify(CONFIG, prompt_tokens=10, max_tokens=None).max_tokens == 256
    near_limit = classify(CONFIG, prompt_tokens=131_000, max_tokens=None)
    assert (near_limit.group, near_limit.max_tokens) == ("long", 72)
    explicit = classify(CONFIG, prompt_tokens=1000, max_tokens=None, path_group="realtime")
    assert explicit.max_tokens == 24


def test_too_long_for_every_group_is_context_length_exceeded():
    with pytest.raises(ContextLengthExceededError) as info:
        classify(CONFIG, prompt_tokens=131_072, max_tokens=None, prompt_param="messages")
    assert (info.value.http_status, info.value.param) == (400, "messages")
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceededError) as info:
        classify(CONFIG, prompt_tokens=100, max_tokens=131_000)
    assert info.value.param == "max_tokens"


def test_explicit_group_must_hold_the_request():
    with pytest.raises(ContextLengthExceededError):
        classify(CONFIG, prompt_tokens=1000, max_tokens=100, header_group="realtime")


def test_unknown_header_group_is_400_naming_the_header():
    with pytest.raises(InvalidRequestError) as info:
        classify(CONFIG, prompt_tokens=5, max_tokens=5, header_group="qos.req.>")
    assert (info.value.http_status, info.value.param) == (400, "X-QoS-Group")


def test_header_contradicting_the_path_is_400():
    with pytest.raises(InvalidRequestError) as info:
        classify(CONFIG, prompt_tokens=5, max_tokens=5, path_group="short", header_group="long")
    assert info.value.param == "X-QoS-Group"


def test_unknown_path_group_is_404():
    with pytest.raises(NotFoundError):
        classify(CONFIG, prompt_tokens=5, max_tokens=5, path_group="gold")


async def test_requests_reach_the_worker_of_the_group_they_were_classified_into(
    nats_config: NatsConfig,
):
    # Test limits: realtime 64, short 256, long 2048 tokens.
    config = gateway_config(nats_config)
    async with (
        serve(config) as gw,
        running_worker(nats_config, "realtime") as realtime,
        running_worker(nats_config, "short") as short,
        running_worker(nats_config, "long") as long,
        httpx.AsyncClient(base_url=gw.url, timeout=5) as http,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        by_path = await http.post("/v1/realtime/completions", json=body)
        by_header = await http.post("/v1/completions", json=body, headers={"X-QoS-Group": "long"})
        by_length = await http.post("/v1/completions", json=body)
        too_long_for_short = await http.post("/v1/completions", json={**body, "max_tokens": 300})
        chat_by_path = await http.post(
            "/v1/realtime/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        )
        bad_header = await http.post("/v1/completions", json=body, headers={"X-QoS-Group": "gold"})
        too_long = await http.post("/v1/completions", json={**body, "max_tokens": 5000})
    assert [r.status_code for r in (by_path, by_header, by_length, too_long_for_short)] == [200] * 4
    assert by_path.headers["X-QoS-Group"] == "realtime"
    assert by_header.headers["X-QoS-Group"] == "long"
    assert by_length.headers["X-QoS-Group"] == "short"
    assert too_long_for_short.headers["X-QoS-Group"] == "long"
    assert chat_by_path.status_code == 200 and chat_by_path.headers["X-QoS-Group"] == "realtime"
    assert len(realtime.jobs) == 2 and len(short.jobs) == 1 and len(long.jobs) == 2
    assert bad_header.status_code == 400 and bad_header.json()["error"]["param"] == "X-QoS-Group"
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"

    # What went over the wire: token ids (never text), a seed, the deadline, the dedupe id.
    job = short.jobs[0]
    request = job.request
    assert request.prompt is None and request.prompt_token_ids == [256, ord("h"), ord("i")]
    assert request.params.seed is not None and request.params.max_tokens == 4
    assert request.id.startswith("cmpl-") and job.headers["Nats-Msg-Id"] == request.id
    assert request.reply == f"{nats_config.subject_prefix}.out.{request.id}"
    assert request.deadline_ms is not None and request.deadline_ms > request.created_ms
    assert job.headers["Qos-Deadline-Ms"] == str(request.deadline_ms)


def test_a_key_bound_to_groups_is_routed_and_refused_within_them():
    """gateway.api_key_groups: another team's key kept off realtime. Named, a group outside
    the key's is a 403; by length, only the key's groups are candidates."""
    with pytest.raises(PermissionDeniedError) as refused:
        classify(CONFIG, prompt_tokens=5, max_tokens=5, path_group="realtime", allowed={"short"})
    assert refused.value.http_status == 403 and refused.value.code == "group_not_allowed"
    assert classify(CONFIG, prompt_tokens=5, max_tokens=5, allowed={"long"}).group == "long"
    # Only a batch-1 group allowed: length routing takes it (else nothing would).
    assert classify(CONFIG, prompt_tokens=5, max_tokens=5, allowed={"realtime"}).group == "realtime"
    with pytest.raises(ContextLengthExceededError, match="this key may use"):
        classify(CONFIG, prompt_tokens=5000, max_tokens=5, allowed={"short"})
