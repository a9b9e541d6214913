"""End-to-end test harness: a real control plane, S3 store and node stand-in on loopback.

A package (rather than loose test modules) so the node stand-in can run as
``python -m e2e.node`` and the modules import each other by one unambiguous name.
"""
