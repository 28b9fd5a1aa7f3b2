"""``GET /metrics`` scraped and parsed with prometheus_client's own parser: the counters and histograms
move with the requests sent, the gauges follow the scheduler, and the names the Gateway API Inference
Extension's endpoint picker reads are there."""

from __future__ import annotations

import json

import pytest
from helpers.http_raw import call
from helpers.serving_harness import serving
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served():
    with serving(http=True) as s:
        yield s


def scrape(served) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels but model_name) -> value, once every finished request's
    record has been counted."""
    served.recorder.flush()
    status, headers, body = call(served.http_url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", "tiny") == "tiny"
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_and_histograms_move_with_the_requests(served) -> None:
    before = scrape(served)
    usages = []
    for n, max_tokens in enumerate((5, 9, 13)):
        body = {"model": "tiny", "prompt": f"count me {n}", "max_tokens": max_tokens, "ignore_eos": True}
        status, _, answer = call(served.http_url + "/v1/completions", "POST", body)
        assert status == 200
        usages.append(json.loads(answer)["usage"])
    served.assert_no_leaked_slots()
    after = scrape(served)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("switchyard_requests_total", finished_reason="length") == 3
    assert moved("switchyard_generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 27
    assert moved("switchyard_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("switchyard_prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    for histogram in ("switchyard_time_to_first_token_seconds", "switchyard_e2e_request_latency_seconds",
                      "switchyard_request_queue_time_seconds", "switchyard_request_generation_tokens"):
        assert moved(histogram + "_count") == 3, histogram
    assert moved("switchyard_inter_token_latency_seconds_count") == 27 - 3  # gaps between tokens
    assert moved("switchyard_request_generation_tokens_sum") == 27
    assert moved("switchyard_engine_step_seconds_count") > 0
    assert moved("switchyard_http_requests_total", route="/v1/completions", status="200") == 3


def test_the_prefix_cache_hits_are_counted(served) -> None:
    prompt = "A shared prefix long enough to fill whole KV blocks of the cache: " * 4
    before = scrape(served)
    for _ in range(2):
        assert call(served.http_url + "/v1/completions", "POST",
                    {"model": "tiny", "prompt": prompt, "max_tokens": 2})[0] == 200
    served.assert_no_leaked_slots()
    after = scrape(served)
    assert value(after, "switchyard_prefix_cache_hits_total") > value(before, "switchyard_prefix_cache_hits_total")


def test_gauges_follow_the_scheduler_and_the_inference_gateway_reads_them(served) -> None:
    served.assert_no_leaked_slots()
    idle = scrape(served)
    for name in ("switchyard_num_requests_running", "switchyard_num_requests_waiting", "vllm:num_requests_waiting",
                 "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "switchyard_kv_cache_usage_ratio", "switchyard_kv_cache_blocks_held"):
        assert (name, ()) in idle and value(idle, name) == 0, name
    blocks = value(idle, "switchyard_kv_cache_blocks")
    assert blocks == served.scheduler.engine.kv_tokens // served.scheduler.engine.kv_block_size
    info = [k for k in idle if k[0] == "vllm:cache_config_info"]
    assert dict(info[0][1])["block_size"] == str(served.scheduler.engine.kv_block_size)

    stream = {"model": "tiny", "prompt": "hold a slot", "max_tokens": 200, "ignore_eos": True, "stream": True}
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps(stream), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read1(64)  # the stream has begun: the request holds a slot and KV blocks
    busy = scrape(served)
    connection.close()
    assert value(busy, "vllm:num_requests_running") == value(busy, "switchyard_num_requests_running") == 1
    assert 0 < value(busy, "vllm:kv_cache_usage_perc") == value(busy, "switchyard_kv_cache_usage_ratio") <= 1
    served.assert_no_leaked_slots()
