"""Test kit: tiny model writers and the greedy-equality checks shared by tests and benches (not runtime code)."""
