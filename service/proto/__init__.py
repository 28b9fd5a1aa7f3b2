"""Wire protocols of the decode service.

``decode.proto`` (package ``switchyard.v1``) and ``grpc_service.proto`` (KServe v2, package
``inference``) are the sources; everything else here is generated from them by
``python -m switchyard.service.proto.generate`` and checked by ``tests/api/test_server_proto.py``.
"""
