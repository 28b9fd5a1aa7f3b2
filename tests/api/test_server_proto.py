"""The protocol sources and their generated code: reproducible, and wire-compatible with Triton."""

from __future__ import annotations

from pathlib import Path

import pytest
from switchyard.service.api import kserve
from switchyard.service.proto import generate


def test_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    import grpc_tools

    generate.generate(tmp_path)
    stale = generate.stale_files(tmp_path)
    assert not stale, (
        f"{stale} differ from a fresh generation (grpcio-tools {getattr(grpc_tools, '__version__', '?')}); "
        "run: python -m switchyard.service.proto.generate"
    )


def test_check_mode_reports_stale_files(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    (tmp_path / "decode_pb2.py").write_text("# edited by hand\n")
    assert generate.stale_files(tmp_path) == ["decode_pb2.py"]


def _fields(message) -> dict[str, tuple]:
    return {
        f.name: (f.number, f.type, f.message_type.name if f.message_type else None,
                 f.containing_oneof.name if f.containing_oneof else None,
                 # repeated vs singular; upb descriptors expose is_repeated, older ones label
                 getattr(f, "is_repeated", None) if hasattr(f, "is_repeated") else f.label)
        for f in message.fields
    }


def _compare(ours, theirs, path: str, *, subset: bool = False) -> None:
    if subset:  # every field we state is theirs, with its number and type; theirs may have more
        mine, other = _fields(ours), _fields(theirs)
        assert {name: other.get(name) for name in mine} == mine, path
    else:
        assert _fields(ours) == _fields(theirs), path
    for nested in ours.nested_types:
        _compare(nested, theirs.nested_types_by_name[nested.name], f"{path}.{nested.name}", subset=subset)


def test_kserve_messages_match_the_triton_client_wire_format() -> None:
    """Every message and RPC we define has the field numbers, types and shapes of the protocol as
    shipped in tritonclient, so the real client can talk to us."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    theirs = service_pb2.DESCRIPTOR
    ours = kserve.FILE
    assert ours.package == theirs.package == "inference"
    for name, message in ours.message_types_by_name.items():
        if name in theirs.message_types_by_name:
            _compare(message, theirs.message_types_by_name[name], name)
        else:  # model_config.proto's messages: we state the part that describes a model to clients
            _compare(message, model_config_pb2.DESCRIPTOR.message_types_by_name[name], name, subset=True)
    their_types = model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    assert {v.name: v.number for v in ours.enum_types_by_name["DataType"].values} == {
        v.name: v.number for v in their_types.values}
    our_service = ours.services_by_name["GRPCInferenceService"]
    their_service = theirs.services_by_name["GRPCInferenceService"]
    for method in our_service.methods:
        other = their_service.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name, other.output_type.full_name), method.name
    assert {m.name for m in our_service.methods} >= {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
        "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex",
    }


def test_kserve_pool_is_private_so_triton_clients_can_share_the_process() -> None:
    from google.protobuf import descriptor_pool

    pytest.importorskip("tritonclient.grpc")
    # Both registered: tritonclient's in the default pool, ours privately; no duplicate-symbol error.
    assert descriptor_pool.Default().FindMessageTypeByName("inference.ModelInferRequest") is not None
    assert kserve.pool().FindMessageTypeByName("inference.ModelInferRequest") is not None
    assert kserve.pool() is not descriptor_pool.Default()
