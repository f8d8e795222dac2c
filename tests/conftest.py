"""Shared fixtures: nothing here starts processes; e2e helpers live in tests/e2e."""
