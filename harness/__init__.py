"""What the tests and the benchmarks share: real processes (a gunicorn greenserve, a local image host with fault
knobs, nginx in front of a fleet, a redis-server), the fault scenarios and the load generator, the unit tests'
fakes and images, and the checks tests make of a server's answers. Both ``tests/`` and ``bench/`` import this; it
imports neither."""
