"""Throughput and memory benchmark of dcp_ext against torch's DCP storage,
s3torchconnector and raw I/O ceilings. Run ``python -m bench --help``."""
