"""Fake of ``flexkv.common``: configuration, requests and storage layouts."""
