"""Attention backends that verify a DDTree draft tree in one target forward (ancestor-only masks on tree rows)."""
