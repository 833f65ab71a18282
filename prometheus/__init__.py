"""Prometheus recording and alerting rules for pte-instrument's metrics, as plain data
(``rules.py``); ``python -m deploy.generate`` writes them to ``prometheus/pte-rules.yml``."""
