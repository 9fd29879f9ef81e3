"""A model's generation_config.json sampling values fill the fields a request leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from common.config import NatsConfig
from common.sampling_defaults import SamplingDefaults, load_sampling_defaults
from common.tokenizer import load_tokenizer
from gateway.openai_api import CompletionRequest, parse_body
from tests.engine.test_tokenizer import write_hf_folder
from tests.gateway.conftest import gateway_config, serve
from tests.gateway.fake_worker import running_worker

# Qwen2.5-Instruct's generation_config.json, as shipped.
QWEN25 = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}


def _folder(tmp_path: Path, generation: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_the_sampling_fields_of_generation_config_are_read(tmp_path: Path) -> None:
    d = load_sampling_defaults(_folder(tmp_path, QWEN25))
    assert d == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert load_sampling_defaults(tmp_path / "nowhere") == SamplingDefaults()
    assert load_sampling_defaults("dummy:tiny") == SamplingDefaults()


def test_values_no_request_could_carry_are_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = {"temperature": "hot", "top_p": 0, "top_k": 2.5, "min_p": 0.05, "repetition_penalty": -1}
    assert load_sampling_defaults(_folder(tmp_path, bad)) == SamplingDefaults(min_p=0.05)
    assert sum("not a valid value" in r.message for r in caplog.records) == 4
    assert load_sampling_defaults(_folder(tmp_path, [1, 2])) == SamplingDefaults()
    (tmp_path / "model" / "generation_config.json").write_text("{not json")
    assert load_sampling_defaults(tmp_path / "model") == SamplingDefaults()


def test_a_request_field_wins_over_the_models_and_a_left_out_one_takes_it() -> None:
    d = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05)

    def params(**fields: object):  # type: ignore[no-untyped-def]
        body = parse_body(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())
        return body.wire_params(4, None, d)

    left_out = params()
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.7, 0.8, 20)
    assert (left_out.min_p, left_out.repetition_penalty) == (0.05, 1.05)
    asked = params(temperature=1.0, top_p=1.0, top_k=-1, min_p=0, repetition_penalty=1.0)
    assert (asked.temperature, asked.top_p, asked.top_k) == (1.0, 1.0, 0)  # -1: off
    assert (asked.min_p, asked.repetition_penalty) == (0.0, 1.0)
    greedy = params(top_p=0)  # "only the likeliest token" stays greedy
    assert (greedy.temperature, greedy.top_p) == (0.0, 1.0)
    plain = parse_body(CompletionRequest, b'{"prompt": "x"}').wire_params(4, None)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (
        1.0, 1.0, 0, 1.0,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["model", "openai"])
async def test_the_gateway_sends_the_models_defaults_unless_told_openais(
    nats_config: NatsConfig, tmp_path: Path, mode: str
) -> None:
    folder = write_hf_folder(tmp_path / "tok")
    (folder / "generation_config.json").write_text(json.dumps(QWEN25))
    config = gateway_config(nats_config)
    config.gateway.sampling_defaults = mode  # type: ignore[assignment]
    async with (
        serve(config, load_tokenizer(str(folder)), model=str(folder)) as gw,
        running_worker(nats_config, "short") as worker,
    ):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        await client.completions.create(model="tok", prompt="hi", max_tokens=3)
        await client.completions.create(model="tok", prompt="hi", max_tokens=3, temperature=0)
    left_out, asked = (job.request.params for job in worker.jobs)
    if mode == "model":
        assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.7, 0.8, 20)
        assert left_out.repetition_penalty == 1.05
    else:
        assert (left_out.temperature, left_out.top_p, left_out.top_k) == (1.0, 1.0, 0)
        assert left_out.repetition_penalty == 1.0
    assert asked.temperature == 0.0
