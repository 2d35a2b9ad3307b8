"""Fake of ``flexkv.server``: the per-rank GPU registration client."""
