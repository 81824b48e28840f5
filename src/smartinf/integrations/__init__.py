"""Integrations of smartinf with training frameworks (import the one you use)."""
