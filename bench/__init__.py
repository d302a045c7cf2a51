"""Benchmarks of capture, freeze and replay: the file store and the Kafka path, side by side.

Run ``python -m bench --help``; results go to ``bench/results/latest.json`` and ``bench/README.md`` explains them.
"""
