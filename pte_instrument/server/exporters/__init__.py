"""Exporters read priced records; they never compute cost."""
