"""Helpers every test suite shares: waiting on conditions, and nothing else yet.

Import as ``from tests.support.<module> import ...`` (the one convention for
helpers shared across suites).
"""
