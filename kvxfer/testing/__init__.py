"""Tools to test backends and lenders: host row memory and the conformance kit.

Importable by users who write their own backend: ``kvxfer.testing.conformance.CHECKS``.
"""
