"""Real processes for the end-to-end tests and the benchmarks: a gunicorn greenserve, a local image host
with fault knobs, and the fault scenarios. Both ``tests/`` and ``bench/`` import this; it imports neither."""
