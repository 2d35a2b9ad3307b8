"""The local demo: agents of one PP group driven by synthetic engine ranks."""
