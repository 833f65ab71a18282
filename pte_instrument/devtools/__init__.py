"""The demo and test harness: never loaded by vLLM."""
