"""Generated gRPC/protobuf stubs of the speckv API, package speckv.v1.

Do not edit: regenerate with ``python proto/generate.py``.
"""
