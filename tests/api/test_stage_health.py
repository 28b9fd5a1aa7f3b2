"""A later pipeline stage's HTTP endpoint: /health follows the stage, /metrics is Prometheus text (the
chart's PodMonitor scrapes every pod of the engine), anything else a JSON 404."""

from __future__ import annotations

import json

from helpers.http_raw import call
from prometheus_client.parser import text_string_to_metric_families
from switchyard.service.api.http.health import HealthEndpoint


def gauge(url: str) -> dict[str, float]:
    status, headers, body = call(url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    (family,) = text_string_to_metric_families(body.decode())
    assert family.type == "gauge"
    return {s.labels["stage"]: s.value for s in family.samples}


def test_health_and_metrics_follow_the_stage() -> None:
    endpoint = HealthEndpoint("127.0.0.1", 0, stage=2)
    url = f"http://127.0.0.1:{endpoint.port}"
    try:
        assert call(url + "/health")[0] == 503
        assert gauge(url) == {"2": 0.0}
        endpoint.serving = True
        assert call(url + "/health")[0] == 200
        assert gauge(url) == {"2": 1.0}
        status, _, body = call(url + "/v1/models")
        assert status == 404 and json.loads(body)["error"]["message"]
    finally:
        endpoint.close()


def test_the_any_address_is_reached_over_ipv4() -> None:
    endpoint = HealthEndpoint("[::]", 0, stage=1)
    try:
        assert call(f"http://127.0.0.1:{endpoint.port}/health")[0] == 503
    finally:
        endpoint.close()
