"""Calls of every transport: admission, lifetime and teardown in one registry (see ``registry``)."""
