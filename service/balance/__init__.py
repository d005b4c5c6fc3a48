"""Balancing across a host's workers: what decides which worker takes a connection.

    board.py            LoadBoard: each worker's load and kept connections in shared memory; the master
                        makes it before forking and gives each worker a ``Seat`` on it
    gate.py             Balance: one worker's connections, its load, whether it accepts (readiness, the
                        accept gate, the idle cap, rebalancing kept connections); the view the engine reads
    gunicorn_worker.py  GreenserveWorker: gunicorn's gevent worker reporting to its Balance, and the
                        listening server the Balance opens and closes

Nothing here imports torch: the master imports this package before it forks.
"""
