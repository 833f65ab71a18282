"""Runs in each vLLM API-server process."""
