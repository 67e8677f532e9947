"""Shared test helpers: `from tests.helpers.<module> import ...`."""
