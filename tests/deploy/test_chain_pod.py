"""The kubelet emulation the chain test relies on (tests/helpers/chain_pod.py): env expansion and fieldRefs as
Kubernetes defines them, and the one-pass mount-path substitution."""

from __future__ import annotations

from pathlib import Path

from helpers.chain_pod import Localizer, container_env, expand, pod_of


def test_expand_follows_kubernetes_rules():
    defined = {"A": "x", "B": "y"}
    assert expand("$(A)-$(B)", defined) == "x-y"
    assert expand("$$(A)", defined) == "$(A)"  # escaped
    assert expand("$(C)", defined) == "$(C)"  # undefined stays as written


def test_container_env_resolves_field_refs_in_order():
    sts = {"metadata": {"name": "tiny", "namespace": "ns"},
           "spec": {"template": {"metadata": {"labels": {"a": "b"}}, "spec": {}}}}
    container = {"env": [
        {"name": "LATER", "value": "$(POD_NAME)"},  # defined after: not expanded
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "STAGE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
        {"name": "ATTRS", "value": "k8s.pod.name=$(POD_NAME)"},
    ]}
    env = container_env(container, pod_of(sts))
    assert env == {"LATER": "$(POD_NAME)", "POD_NAME": "tiny-0", "STAGE": "0", "ATTRS": "k8s.pod.name=tiny-0"}


def test_localizer_rewrites_each_path_once():
    local = Localizer({"/models/tiny": Path("/tmp/x/models"), "/etc/switchyard": Path("/tmp/x/etc")},
                      {8001: 40000, 8000: 40001})
    assert local.argv(["serve", "--layout", "/etc/switchyard/layout.json", "--port", "8001", "--model-path",
                       "/models/tiny", "--http-port", "8000", "--max-tokens", "8000"]) == [
        "serve", "--layout", "/tmp/x/etc/layout.json", "--port", "40000", "--model-path", "/tmp/x/models",
        "--http-port", "40001", "--max-tokens", "8000"]
    assert local.path("/models/tinyish") == "/models/tinyish"  # a prefix of a name is not a mount
    text = '{"model_path": "/models/tiny", "other": "/models/tinyish"}'
    assert local.text(text) == '{"model_path": "/tmp/x/models", "other": "/models/tinyish"}'
